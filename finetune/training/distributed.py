"""The engines past one GPU, through accelerate's own objects: the process group (its timeout, SLURM's ``srun``
variables), DeepSpeed's "auto" values resolved from the recipe (:func:`resolve_deepspeed`), FSDP's layers to wrap
(:func:`layer_classes`), and whether the trained weights are sharded (:func:`sharded`).

DeepSpeed: ``accelerate config`` / ``--use_deepspeed`` writes ``"auto"`` for the batch sizes, the accumulation and
the clipping; accelerate resolves them only when a dataloader is prepared, which a run never does for its model
(the loop prepares the module, the optimiser and the schedule). :func:`resolve_deepspeed` fills them from the recipe
through the plugin's own :meth:`~accelerate.utils.DeepSpeedPlugin.deepspeed_config_process` (a value given in the
config that disagrees with the recipe is an error naming both), the optimiser and schedule keys when the config has
an ``optimizer`` / ``scheduler`` section, and the bucket sizes from the model's width.

FSDP: accelerate's transformer wrap policy reads ``_no_split_modules`` of the module it wraps; the run's
:class:`~finetune.training.step.TrainModule` sets it to :func:`layer_classes` of its model, so that each encoder
layer of every family is its own FSDP unit (``fsdp_transformer_layer_cls_to_wrap`` in an accelerate config
overrides it).

Checked on one H200 (2026-11-27, ``bench/gpu_checks.sh``): :func:`check_engine` refuses DeepSpeed releases that cannot
start these models, and :func:`load_whole_under_zero3` keeps transformers from partitioning the start model while it
loads under ZeRO-3.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from finetune.config import RecipeError

log = logging.getLogger("xlipkit")

__all__ = ["UNUSABLE_DEEPSPEED", "average_gradients", "check_engine", "checkpoint_engine", "deepspeed_objects",
           "engine_record", "fsdp2_scalars", "gathered_model", "layer_classes", "load_whole_under_fsdp",
           "load_whole_under_zero3", "local_shards", "resolve_deepspeed", "resume_problem", "sharded",
           "slurm_environment"]

#: DeepSpeed releases that cannot start a model with a 0-dim parameter (CLIP's ``logit_scale``, SigLIP's
#: ``logit_bias``), and why. Seen on an H200 with 0.19.8 (2026-11-27); 0.19.5 to 0.19.7 broadcast ``p.data`` itself.
UNUSABLE_DEEPSPEED = {
    "0.19.8": "its engine views every parameter as bytes for its first broadcast (p.data.view(torch.uint8) in "
              "DeepSpeedEngine._broadcast_model), which torch refuses for a 0-dim parameter such as CLIP's "
              "logit_scale (\"self.dim() cannot be 0 to view BFloat16 as Byte\")",
}


def slurm_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Under ``srun`` with one task per GPU (no launcher), the process group's variables from SLURM's, as open_clip
    does: ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``,
    ``LOCAL_WORLD_SIZE`` = the tasks on this node. Set into ``environ`` (``os.environ`` by default) only inside a job
    step of several tasks whose launcher did not set them already (``torchrun`` / ``accelerate launch`` under
    ``srun`` set ``RANK`` themselves). Returns what it set.

    Raises:
        RuntimeError: several tasks but no ``MASTER_ADDR`` / ``MASTER_PORT`` (the job script exports them).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return {}
    tasks = int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or 1)
    if tasks <= 1:
        return {}
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise RuntimeError(
            f"srun started {tasks} tasks, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: "
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) and MASTER_PORT=29500 "
            "in the job script before srun (docs/guides/scaling.md)")
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or str(tasks // int(env.get("SLURM_NNODES", 1)))
    values = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(tasks), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
              "LOCAL_WORLD_SIZE": per_node}
    env.update(values)
    return values


def engine_record(accelerator: Any) -> dict[str, Any]:
    """What trained, for ``metrics.json``: accelerate's distributed type, the processes and their backend, and the
    engine's own settings (FSDP's version and state-dict type, DeepSpeed's ZeRO stage)."""
    import torch

    record: dict[str, Any] = {"distributed_type": str(accelerator.distributed_type).split(".")[-1],
                              "num_processes": accelerator.num_processes, "device": accelerator.device.type}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        record["backend"] = str(torch.distributed.get_backend())
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if record["distributed_type"] == "FSDP" and fsdp is not None:
        record.update(fsdp_version=getattr(fsdp, "fsdp_version", 1),
                      state_dict_type=str(fsdp.state_dict_type).split(".")[-1])
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if record["distributed_type"] == "DEEPSPEED" and deepspeed is not None:
        record["zero_stage"] = deepspeed.zero_stage
    return record


def checkpoint_engine(folder: Path) -> tuple[str, int | None]:
    """Which engine wrote a checkpoint (accelerate's ``save_state`` layout) and, for DeepSpeed, on how many processes:
    ``("deepspeed", N)`` (``pytorch_model/`` with one ``zero_pp_rank_<r>_*optim_states.pt`` per process), ``("fsdp",
    None)`` (``pytorch_model_fsdp_0/`` sharded, or ``pytorch_model_fsdp_0.bin`` whole), else ``("plain", None)``."""
    engine_dir = folder / "pytorch_model"
    if engine_dir.is_dir():
        ranks = {p.name.split("_")[3] for p in engine_dir.glob("zero_pp_rank_*_optim_states.pt")}
        return "deepspeed", len(ranks) or None
    if any(folder.glob("pytorch_model_fsdp_*")):
        return "fsdp", None
    return "plain", None


def resume_problem(folder: Path, accelerator: Any) -> str | None:
    """Why this launch cannot resume the checkpoint ``folder``, or None: the engine that wrote it must be the run's
    (each writes its own layout), and a DeepSpeed ZeRO checkpoint resumes on its own number of processes only
    (DeepSpeed partitions the optimiser's state per process and refuses another count). An FSDP checkpoint resumes
    on any number: torch's distributed checkpoint reshards it as it loads."""
    from accelerate.utils import DistributedType

    saved, processes = checkpoint_engine(Path(folder))
    kind = accelerator.distributed_type
    running = ("deepspeed" if kind == DistributedType.DEEPSPEED else "fsdp" if kind == DistributedType.FSDP
               else "plain")
    launch = {"deepspeed": "accelerate launch --use_deepspeed", "fsdp": "accelerate launch --use_fsdp "
              "--fsdp_version 2", "plain": "a launch without FSDP or DeepSpeed"}
    if saved != running:
        return (f"train.resume: the checkpoint {folder} was written by a {saved} run ({launch[saved]}), this launch "
                f"is a {running} one: each engine reads only its own checkpoints; resume with {launch[saved]}")
    if saved == "deepspeed" and processes is not None and processes != accelerator.num_processes:
        return (f"train.resume: the checkpoint {folder} was written by DeepSpeed ZeRO on {processes} processes, this "
                f"launch has {accelerator.num_processes}: DeepSpeed partitions the optimiser's state per process and "
                f"cannot resume it on another number. Resume with --num_processes {processes} (FSDP checkpoints "
                "resume on any number of processes)")
    return None


def sharded(accelerator: Any) -> bool:
    """Whether the trained weights are sharded over the processes (FSDP, DeepSpeed ZeRO-3): the final model is then
    gathered with ``accelerator.get_state_dict``."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return True
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return kind == DistributedType.DEEPSPEED and plugin is not None and plugin.hf_ds_config.is_zero3()


def check_engine(accelerator: Any) -> None:
    """Stop a DeepSpeed run at once, before anything loads, when the installed DeepSpeed is one of
    :data:`UNUSABLE_DEEPSPEED`; the message names the release and the install command that avoids it.

    Raises:
        RecipeError: an unusable DeepSpeed release (the run exits with status 2).
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    import deepspeed

    why = UNUSABLE_DEEPSPEED.get(getattr(deepspeed, "__version__", ""))
    if why:
        raise RecipeError(f"DeepSpeed {deepspeed.__version__} cannot train these models: {why}. Install another "
                          "release: pip install -e \".[deepspeed]\" in the clone (or pip install \"deepspeed!=0.19.8\"), or "
                          "use FSDP (docs/guides/scaling.md)")


def load_whole_under_zero3(accelerator: Any) -> bool:
    """Under DeepSpeed ZeRO-3, let the run load its models whole; returns whether anything changed.

    accelerate registers its DeepSpeed config with transformers (``HfDeepSpeedConfig``) whatever
    ``zero3_init_flag`` says, and transformers then builds every model inside ``deepspeed.zero.Init``: each weight is
    partitioned as it is made, so Long-CLIP's stretching of the text positions (which reads and rewrites the table
    after loading) sees an empty ``(0,)`` tensor. The registration is dropped for the run: the start model, and the
    runs ``eval.compare_with`` loads, load whole (a CLIP-size model fits one GPU) and DeepSpeed partitions the model
    that trains when accelerate prepares it. ``zero3_init_flag: true`` is not used (logged).
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or not sharded(accelerator):
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    if not is_deepspeed_zero3_enabled():
        return False
    unset_hf_deepspeed_config()
    if getattr(plugin, "zero3_init_flag", False):
        log.info("DeepSpeed ZeRO-3: zero3_init_flag is not used; models load whole and are partitioned when the "
                 "model that trains is prepared (Long-CLIP's position stretching reads the whole table)")
    return True


def load_whole_under_fsdp(accelerator: Any) -> bool:
    """Under FSDP, let the run load its models whole on every process; returns whether anything changed.

    ``accelerate launch --use_fsdp`` turns on ``fsdp_cpu_ram_efficient_loading`` by default: transformers then loads
    the weights on local rank 0 only (the other processes keep empty tensors until accelerate broadcasts rank 0's
    when the model is prepared), and accelerate moves the model to the meta device before sharding it, which makes
    new parameter objects, so the scalars :func:`fsdp2_scalars` leaves out are no longer the model's ("fully_shard
    doesn't support scalar parameters"). The run changes its model before it is prepared on every process
    (Long-CLIP's position stretching, the adapter), so the setting is turned off for the run (logged): a CLIP-size
    model fits one process."""
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type != DistributedType.FSDP or plugin is None:
        return False
    if not (plugin.cpu_ram_efficient_loading or os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "") == "true"):
        return False
    plugin.cpu_ram_efficient_loading = False
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"  # what transformers reads as it loads a model
    log.info("FSDP: fsdp_cpu_ram_efficient_loading is not used; every process loads the models whole (the run "
             "stretches and adapts the model before it is sharded)")
    return True


def fsdp2_scalars(accelerator: Any, module: nn.Module) -> list[nn.Parameter]:
    """Under FSDP2, the module's 0-dim parameters (CLIP's ``logit_scale``, SigLIP's ``logit_bias``, a term's
    temperature), which ``fully_shard`` refuses ("fully_shard doesn't support scalar parameters"): given to accelerate
    as ignored (``fsdp_plugin.ignored_modules``), so they stay whole on every process, and returned so that the loop
    averages their gradients (:func:`average_gradients`). Elsewhere ``[]``."""
    from accelerate.utils import DistributedType

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type != DistributedType.FSDP or getattr(plugin, "fsdp_version", 1) != 2:
        return []
    scalars = [p for p in module.parameters() if p.dim() == 0]
    if scalars:
        holder = nn.Module()
        for i, p in enumerate(scalars):
            holder.register_parameter(f"scalar_{i}", p)
        existing = plugin.ignored_modules
        plugin.ignored_modules = [holder, *(existing if isinstance(existing, (list, tuple)) else [])]
        if isinstance(existing, str):
            log.warning("FSDP2: fsdp_ignored_modules=%r is replaced by the model's scalar parameters", existing)
    return scalars


def local_shards(params: list[nn.Parameter]) -> list[Any]:
    """The part of each parameter this process holds, the empty ones left out: a DTensor's local shard (FSDP2), a
    ZeRO-3 parameter's partition (``ds_tensor``; the parameter itself is then an empty tensor), else the parameter.
    What the loop's NaN check reads (an infinity norm has no value on an empty tensor)."""
    out = []
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p)
        if local.numel():
            out.append(local)
    return out


def average_gradients(params: list[nn.Parameter], num_processes: int) -> None:
    """Average the gradients of parameters no engine reduces (:func:`fsdp2_scalars`) over the processes."""
    import torch

    if num_processes < 2 or not params:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.stack([g.reshape(()) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= num_processes
    for g, value in zip(grads, flat):
        g.copy_(value.reshape(g.shape))


def layer_classes(model: nn.Module) -> list[str]:
    """The class names of the encoder layers of ``model`` (any family), each to be one FSDP unit: the
    ``_no_split_modules`` of every transformers model inside it that are present, and the blocks repeated in an
    ``nn.ModuleList`` / ``nn.Sequential`` (open_clip's ``ResidualAttentionBlock``, FLAIR's and F-CAST's own layers).
    Sorted, each once."""
    present = {type(m).__name__ for m in model.modules()}
    names: set[str] = set()
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if name in present:
                names.add(name)
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and not issubclass(next(iter(kinds)), (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                kind = kinds.pop()
                if any(isinstance(p, nn.Parameter) for p in module[0].parameters()) and len(list(module[0].children())):
                    names.add(kind.__name__)
    return sorted(names)


#: DeepSpeed keys whose given value must equal the recipe's (the others: the config's own choice stands)
_MUST_MATCH = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")


def _width(model: nn.Module) -> int:
    """The largest hidden size of the towers (for DeepSpeed's bucket sizes)."""
    sizes = [getattr(m.config, "hidden_size", 0) for m in model.modules() if hasattr(m, "config")]
    sizes += [getattr(m, "width", 0) for m in model.modules() if isinstance(getattr(m, "width", None), int)]
    sizes = [s for s in sizes if isinstance(s, int) and s > 0]
    return max(sizes) if sizes else 768


def resolve_deepspeed(plugin: Any, recipe: Any, num_processes: int, model: nn.Module,
                      total_steps: int) -> dict[str, Any]:
    """Fill the "auto" values of ``plugin``'s DeepSpeed config from the recipe (see the module), in place, and
    return what was filled.

    Args:
        plugin: ``accelerator.state.deepspeed_plugin`` (an ``accelerate.utils.DeepSpeedPlugin``).
        recipe: the run's recipe (``train.batch_size`` is the global batch of one optimiser step).
        num_processes: processes of the launch.
        model: the module that trains (its width sizes the buckets).
        total_steps: optimiser steps of the run (the schedule's length).
    Raises:
        ValueError: a value the config gives that disagrees with the recipe (naming both and the recipe key).
    """
    t = recipe.train
    micro = t.batch_size // (num_processes * t.accumulation_steps)
    width = _width(model)
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": t.batch_size,
        "gradient_accumulation_steps": t.accumulation_steps,
        "gradient_clipping": float(t.grad_clip or 0.0),
        "zero_optimization.reduce_bucket_size": width * width,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * width * width),
        "zero_optimization.stage3_param_persistence_threshold": 10 * width,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
        "optimizer.params.lr": t.lr,
        "optimizer.params.betas": list(t.betas),
        "optimizer.params.eps": t.eps,
        "optimizer.params.weight_decay": t.weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": t.lr,
        "scheduler.params.warmup_num_steps": max(1, t.warmup_steps),
        "scheduler.params.total_num_steps": total_steps,
    }
    config = plugin.deepspeed_config
    filled = {k: v for k, v in values.items() if plugin.is_auto(k)}
    if config.get("gradient_accumulation_steps") == 1 and t.accumulation_steps != 1:
        config["gradient_accumulation_steps"] = "auto"  # accelerate writes 1 when the config names none
        filled["gradient_accumulation_steps"] = t.accumulation_steps
    mismatches: list[str] = []
    for key in values:  # accelerate's own filling: "auto" takes the recipe's value, a given value must agree
        plugin.fill_match(key, mismatches, must_match=key in _MUST_MATCH, **values)
    if mismatches:
        raise ValueError(
            f"the DeepSpeed config disagrees with the recipe ({'; '.join(m.strip('- ') for m in mismatches)}). "
            f"train.batch_size={t.batch_size} is the global batch: {num_processes} processes x "
            f"train.accumulation_steps={t.accumulation_steps} x {micro} per micro-batch; set these DeepSpeed keys to "
            "\"auto\" or change the recipe")
    if config.get("gradient_clipping") == 0.0 and not t.grad_clip:
        del config["gradient_clipping"]  # no clipping
    if plugin.hf_ds_config.is_zero3() and not plugin.get_value(
            "zero_optimization.stage3_gather_16bit_weights_on_model_save"):
        # accelerate's get_state_dict gathers ZeRO-3 weights only with it; final/ and the evaluation need them
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        filled["zero_optimization.stage3_gather_16bit_weights_on_model_save"] = True
    log.info("DeepSpeed config resolved from the recipe: %s", ", ".join(f"{k}={v}" for k, v in filled.items()))
    return filled


class _RecipeView:
    """The ``recipe.train`` shape :func:`resolve_deepspeed` reads, over the loop's ``train`` section."""

    def __init__(self, train: Any) -> None:
        self.train = train


def deepspeed_objects(accelerator: Any, module: nn.Module, optimizer: Any, scheduler: Any, train: Any,
                      total_steps: int) -> tuple[Any, Any]:
    """Under DeepSpeed, before ``accelerator.prepare``: the "auto" values resolved from the recipe's ``train`` section
    (:func:`resolve_deepspeed`); where the DeepSpeed config has an ``optimizer`` / ``scheduler`` section,
    accelerate's ``DummyOptim`` / ``DummyScheduler`` over the run's parameter groups take the place of the run's
    own (which are returned otherwise)."""
    from accelerate.utils import DummyOptim, DummyScheduler

    plugin = accelerator.state.deepspeed_plugin
    resolve_deepspeed(plugin, _RecipeView(train), accelerator.num_processes, module, total_steps)
    config = plugin.deepspeed_config
    if "optimizer" in config:
        optimizer = DummyOptim(optimizer.param_groups, lr=train.lr, weight_decay=train.weight_decay)
        if "scheduler" in config:
            scheduler = DummyScheduler(optimizer, total_num_steps=total_steps, warmup_num_steps=train.warmup_steps)
    return optimizer, scheduler


def gathered_model(accelerator: Any, wrapped: nn.Module, skeleton: nn.Module) -> nn.Module:
    """``skeleton`` (the model as it was before FSDP or ZeRO-3 sharded it) loaded with the trained weights gathered
    by ``accelerator.get_state_dict(wrapped)`` (the run's :class:`~finetune.training.step.TrainModule`, keys
    ``model.*``), on every process, on the device. A collective: every process calls it."""
    import torch

    state = accelerator.get_state_dict(wrapped)  # whole on the main process (FSDP: rank 0 only)
    if accelerator.num_processes > 1:
        box = [state if accelerator.is_main_process else None]
        torch.distributed.broadcast_object_list(box, src=0)
        state = box[0]
    weights = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    skeleton.load_state_dict(weights)
    return skeleton.to(accelerator.device)
