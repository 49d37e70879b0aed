"""Recipes: the typed schema, YAML loading, ``key.sub=value`` overrides and errors (DESIGN 2-3).

The package, one module per concern (each imports only those listed before it):

- :mod:`finetune.config.errors`: :class:`RecipeError` and pydantic's errors turned into messages that name
  the file and line (or the override), the key, what was expected and how to fix it.
- :mod:`finetune.config.values`: value types (YAML 1.1 numbers and words, ranges) and options classes.
- :mod:`finetune.config.sources`: dataset entries (``data.train``, ``eval.sets``), turned into typed
  :class:`~finetune.data.sources.SourceSpec` objects once, at load time.
- :mod:`finetune.config.io`: reading YAML safely and writing the resolved recipe.
- :mod:`finetune.config.overrides`: ``key.sub=value`` overrides.
- :mod:`finetune.config.terms`: the options of objective terms (:func:`register_term_config`) and
  ``objective.import``.
- :mod:`finetune.config.schema`: the sections, :class:`Recipe` and :func:`load_recipe`.

Every name is importable from ``finetune.config`` as before the package existed.
"""

from __future__ import annotations

from finetune.config.errors import RecipeError, mask_secrets, refuse_recipe, secret_key
from finetune.config.io import (MAX_YAML_VALUES, BoundedSafeLoader, YAMLAliasError, check_aliases, dump_recipe,
                                list_recipes, recipe_to_dict, safe_load_yaml)
from finetune.config.schema import (AdapterConfig, DataConfig, EvalConfig, HubConfig, KPSConfig, ModelConfig,
                                    ObjectiveConfig, OutputConfig, Recipe, TrainConfig, load_recipe,
                                    recipe_json_schema)
from finetune.config.sources import parse_source_shorthand, parse_sources, source_spec_keys
from finetune.config.terms import TRUST_FLAG, TRUST_RULE, register_term_config, registered_term_configs

__all__ = [
    "TRUST_FLAG",
    "TRUST_RULE",
    "AdapterConfig",
    "DataConfig",
    "EvalConfig",
    "HubConfig",
    "KPSConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OutputConfig",
    "Recipe",
    "RecipeError",
    "TrainConfig",
    "dump_recipe",
    "list_recipes",
    "load_recipe",
    "parse_source_shorthand",
    "parse_sources",
    "recipe_json_schema",
    "recipe_to_dict",
    "refuse_recipe",
    "register_term_config",
    "registered_term_configs",
    "source_spec_keys",
]

# also importable as before (not part of __all__)
_ALSO = (MAX_YAML_VALUES, BoundedSafeLoader, YAMLAliasError, check_aliases, mask_secrets, safe_load_yaml,
         secret_key)

