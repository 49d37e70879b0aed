"""The engines past one GPU through accelerate's own objects (finetune.training.distributed): DeepSpeed's "auto" values
resolved from the recipe with accelerate's DeepSpeedPlugin, accumulation counted by accelerate's accumulate (the
optimiser steps once per accumulated batch), the encoder layers FSDP wraps in every family (accelerate's FSDP2 wrap
policy over the run's module) and the state dict gathered from a model torch's ``fully_shard`` sharded (accelerate's
FSDP needs a GPU type; CPU processes are MULTI_CPU), LoRA and DoRA sharded too, SLURM's srun variables and the
process-group timeout."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from finetune.training.distributed import layer_classes, resolve_deepspeed, slurm_environment

REPO = Path(__file__).resolve().parents[3]

# what `accelerate config` writes for ZeRO-3 with a DeepSpeed config file of HF's examples: every size "auto"
_ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto",
                                "stage3_gather_16bit_weights_on_model_save": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "bf16": {"enabled": "auto"}}


def _recipe(**train):
    from finetune.config import load_recipe

    overrides = [f"train.{k}={v}" for k, v in train.items()]
    return load_recipe(REPO / "recipes" / "quickstart_clip.yaml", overrides)


def _model(name: str = "tiny-clip"):
    from finetune import load_model

    return load_model(f"random:{name}")


def test_deepspeed_zero3_auto_values_come_from_the_recipe():
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=dict(_ZERO3, zero_optimization=dict(_ZERO3["zero_optimization"])))
    recipe = _recipe(batch_size=32, accumulation_steps=4, grad_clip=1.5, lr=2e-4, warmup_steps=7, weight_decay=0.05)
    filled = resolve_deepspeed(plugin, recipe, 2, _model(), total_steps=100)
    config = plugin.deepspeed_config
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"],
            config["gradient_accumulation_steps"], config["gradient_clipping"]) == (4, 32, 4, 1.5)
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 7,
                                             "total_num_steps": 100}
    assert config["zero_optimization"]["reduce_bucket_size"] == 32 * 32  # tiny-clip's width
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True  # final/ gathers
    assert plugin.get_value("gradient_accumulation_steps") == 4 and "train_batch_size" in filled
    assert config["bf16"] == {"enabled": "auto"}  # accelerate fills it from train.mixed_precision
    assert [v for v in _leaves(config) if v == "auto"] == ["auto"]  # nothing else left for prepare to refuse


def _leaves(d):
    for v in d.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])


def test_deepspeed_zero2_from_accelerate_flags_and_a_mismatch_named():
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)  # `accelerate launch --use_deepspeed --zero_stage 2`: sizes "auto"
    resolve_deepspeed(plugin, _recipe(batch_size=16, accumulation_steps=2, grad_clip="null"), 4, _model(),
                      total_steps=10)
    assert (plugin.get_value("train_micro_batch_size_per_gpu"), plugin.get_value("train_batch_size"),
            plugin.get_value("gradient_accumulation_steps")) == (2, 16, 2)
    assert "gradient_clipping" not in plugin.deepspeed_config  # no train.grad_clip: no clipping
    fixed = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match=r"train\.batch_size=16 is the global batch: 4 processes x "
                                         r"train\.accumulation_steps=2 x 2 per micro-batch"):
        resolve_deepspeed(fixed, _recipe(batch_size=16, accumulation_steps=2), 4, _model(), total_steps=10)


def test_the_optimiser_steps_once_per_accumulated_batch_counted_by_accelerate(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from finetune.data.synthetic import synthetic_scenes
    from finetune.objectives.base import Objective
    from finetune.objectives.contrastive import ClipTerm
    from finetune.training.environment import make_accelerator
    from finetune.training.loop import build_loop
    from finetune.training.recipe import FinetuneRecipe
    from finetune.training.step import TrainModule

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = _recipe(batch_size=8, accumulation_steps=4, max_steps=3, trackers="[]", warmup_steps=0)
    acc = make_accelerator(recipe)
    assert acc.gradient_accumulation_steps == 4
    model = _model()
    module = TrainModule(model, Objective(ClipTerm(), []))
    scenes = [dict(r) for r in synthetic_scenes(16, 0, image_size=32)]
    loop = build_loop(acc, module, scenes, recipe.train, tmp_path)
    inner = loop.optimizer.optimizer
    steps, syncs = [], []
    original_step = inner.step
    inner.step = lambda *a, **k: (steps.append(acc.step), original_step(*a, **k))[1]
    original_backward = acc.backward
    acc.backward = lambda loss, **k: (syncs.append(acc.sync_gradients), original_backward(loss, **k))[1]
    FinetuneRecipe.from_loop(loop).train()
    assert acc.step == 12  # accelerate counted 3 x 4 micro-batches
    assert syncs == [False, False, False, True] * 3  # gradients synchronised on the last micro-batch only
    assert steps == [4, 8, 12]  # the optimiser stepped once per accumulated batch
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


_FAMILIES = {  # named config -> the encoder-layer classes FSDP wraps (each its own unit)
    "tiny-clip": {"CLIPEncoderLayer"},
    "tiny-siglip": {"SiglipEncoderLayer"},
    "tiny-siglip2": {"Siglip2EncoderLayer"},
    "tiny-openclip": {"ResidualAttentionBlock"},
    "tiny-vision-text-vit": {"ViTLayer", "BertLayer"},
    "tiny-vision-text-swin": {"SwinStage", "BertLayer"},
    "tiny-flair": {"ResidualAttentionBlock"},
    "fcast-tiny": {"_Block"},
}


@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_fsdp_wraps_every_encoder_layer_of_each_family(name):
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from finetune.objectives.base import Objective
    from finetune.objectives.contrastive import ClipTerm
    from finetune.training.step import TrainModule

    model = _model(name)
    module = TrainModule(model, Objective(ClipTerm(), []))
    assert _FAMILIES[name] <= set(module._no_split_modules) == set(layer_classes(model))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, module)  # accelerate reads module._no_split_modules
    wrapped = [type(m).__name__ for m in module.modules() if policy(m)]
    for cls in _FAMILIES[name]:
        expected = sum(type(m).__name__ == cls for m in model.modules())
        assert expected >= 2 and wrapped.count(cls) == expected, (cls, wrapped)
    assert not policy(module) and not policy(model)  # the root is wrapped by accelerate itself, not by the policy


_FSDP_SCRIPT = textwrap.dedent('''
    """For each adapter given (one launch, one model after another): shard a TrainModule with torch's fully_shard
    (accelerate's FSDP2 path, its wrap policy and our scalar parameters left out), train one step, gather the full
    state dict as accelerate's get_state_dict does and load it into the copy taken before sharding; write JSON."""
    import copy, json, os, sys
    import torch
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from finetune import load_model
    from finetune.config.schema import AdapterConfig
    from finetune.data.collate import Collator
    from finetune.data.synthetic import synthetic_scenes
    from finetune.models.adapters import apply_adapter
    from finetune.objectives.base import Objective
    from finetune.objectives.contrastive import ClipTerm
    from finetune.training.distributed import average_gradients, gathered_model
    from finetune.training.step import TrainModule

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()


    class Accelerator:  # what gathered_model reads of accelerate's, with its FSDP2 get_state_dict (accelerate >= 1.x)
        num_processes, is_main_process, device = world, rank == 0, torch.device("cpu")

        def get_state_dict(self, model):
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
            return get_model_state_dict(model, options=options)


    def shard_train_gather(adapter):
        torch.manual_seed(0)
        model = load_model("random:tiny-clip")
        if adapter != "full":
            model = apply_adapter(model, AdapterConfig(type=adapter))
        module = TrainModule(model, Objective(ClipTerm(), []))
        skeleton = copy.deepcopy(module.model)
        scalars = [p for p in module.parameters() if p.dim() == 0]
        policy = fsdp2_prepare_auto_wrap_policy(
            FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap"), module)
        units = [m for m in module.modules() if policy(m)]
        for unit in units:
            fully_shard(unit)
        fully_shard(module, ignored_params=set(scalars))
        sharded = sum(isinstance(p, DTensor) for p in module.parameters())
        trainable = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trainable, lr=0.1)
        batch = Collator(model, module.objective)([dict(r) for r in synthetic_scenes(4, rank, image_size=32)])
        out = module(batch)
        out["loss"].backward()
        average_gradients(scalars, world)
        opt.step()
        weights = gathered_model(Accelerator(), module, skeleton).state_dict()
        record = {"rank": rank, "world": world, "units": len(units), "sharded": sharded,
                  "gathered": len(weights), "loss": float(out["loss"].detach()),
                  "logit_scale_grad": float(model.logit_scale.grad),
                  "trainable": len(trainable), "norm": float(sum(v.float().norm() for v in weights.values()))}
        with open(f"record-{adapter}-{rank}.json", "w") as f:  # a file per rank: lines of two can mix on stdout
            json.dump(record, f)


    for adapter in sys.argv[1:]:
        shard_train_gather(adapter)
    torch.distributed.destroy_process_group()
''')


@pytest.mark.slow
def test_fully_sharded_model_trains_and_gathers_whole(tmp_path):
    """Fully trained, LoRA and DoRA models, one after another in one launch of two processes."""
    import json

    adapters = ["full", "lora", "dora"]
    script = tmp_path / "fsdp.py"
    script.write_text(_FSDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *adapters]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for adapter in adapters:
        records = [json.loads((tmp_path / f"record-{adapter}-{rank}.json").read_text()) for rank in range(2)]
        assert [(r["rank"], r["world"]) for r in records] == [(0, 2), (1, 2)]
        assert records[0]["units"] == 6, adapter  # 2 + 2 encoder layers, the text and vision embeddings
        assert records[0]["sharded"] > 0 and records[0]["gathered"] == records[1]["gathered"] > 0, adapter
        assert records[0]["norm"] == pytest.approx(records[1]["norm"]), adapter  # the same whole weights on both
        assert records[0]["loss"] != records[1]["loss"], adapter  # each process its own batch
        assert records[0]["logit_scale_grad"] == pytest.approx(records[1]["logit_scale_grad"]), adapter  # averaged
    # the adapters are what trains: fewer trainable tensors than the whole model
    trainable = {a: json.loads((tmp_path / f"record-{a}-0.json").read_text())["trainable"] for a in adapters}
    assert trainable["lora"] < trainable["full"] and trainable["dora"] < trainable["full"], trainable


def test_srun_variables_become_the_process_group_s():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
           "SLURM_STEP_ID": "0", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert slurm_environment(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert env["RANK"] == "5"
    launcher = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "RANK": "3"}  # torchrun under srun
    assert slurm_environment(launcher) == {} and launcher["RANK"] == "3"
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}  # the job script itself, outside srun
    assert slurm_environment(batch_script) == {} and "RANK" not in batch_script
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT are not set: export MASTER_ADDR"):
        slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})


def test_process_group_timeout_comes_from_the_recipe():
    from accelerate.state import AcceleratorState, GradientState

    from finetune.training.environment import make_accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = _recipe(process_group_timeout_s=5400)
    acc = make_accelerator(recipe)
    assert acc.init_handler.timeout == datetime.timedelta(seconds=5400)
    assert _recipe().train.process_group_timeout_s == 7200  # the default outlasts a first download
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


_SRUN_SCRIPT = textwrap.dedent('''
    import json, os, sys
    from finetune.cli.train import main
    from finetune.training import TrainStep

    original = TrainStep.forward_backward

    def recording(self, batch):
        with open(os.path.join(sys.argv[1], f"rank_{self.accelerator.process_index}.json"), "w") as f:
            json.dump({"rank": self.accelerator.process_index, "world": self.accelerator.num_processes,
                       "env_rank": os.environ["RANK"], "local_rank": os.environ["LOCAL_RANK"]}, f)
        return original(self, batch)

    TrainStep.forward_backward = recording
    from finetune.process_exit import exit_process

    exit_process(main(sys.argv[2:]))  # as finetune/run.py ends
''')


@pytest.mark.slow
def test_two_srun_tasks_train_as_one_run(tmp_path):
    """``srun --ntasks 2 python finetune/run.py RECIPE`` (one task per GPU, no launcher): each task is started with
    SLURM's variables only, as srun starts it, and the two form one process group."""
    import json

    from finetune.models.registry import save_tiny

    tiny = save_tiny("tiny-clip", tmp_path / "tiny")
    script = tmp_path / "srun_task.py"
    script.write_text(_SRUN_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    args = [str(REPO / "recipes" / "quickstart_clip.yaml"), f"model.name_or_path={tiny}", "model.dtype=null",
            "model.max_text_len=null", "data.train={name: synthetic, size: 16, seed: 0, options: {image_size: 32}}",
            "eval.sets=[]", "eval.compare_base_length=false", "train.batch_size=4", "train.max_steps=2",
            "train.trackers=[]", "train.mixed_precision=no", f"output.dir={tmp_path / 'run'}",
            "model.init_from=null", "eval.compare_with=[]"]
    procs = []
    for task in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true",
                   SLURM_PROCID=str(task), SLURM_NTASKS="2", SLURM_LOCALID=str(task), SLURM_NTASKS_PER_NODE="2",
                   SLURM_NNODES="1", SLURM_STEP_ID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(tmp_path / f"task{task}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), *args], env=env, cwd=tmp_path,
                                      stdout=log, stderr=subprocess.STDOUT))
    for task, proc in enumerate(procs):
        assert proc.wait(timeout=600) == 0, (tmp_path / f"task{task}.log").read_text()[-4000:]
    records = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"], r["env_rank"], r["local_rank"]) for r in records] == [(0, 2, "0", "0"),
                                                                                         (1, 2, "1", "1")]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["steps"] == 2


def _deepspeed_accelerator(plugin):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(deepspeed_plugin=plugin))


def test_an_unusable_deepspeed_release_stops_the_run_with_the_install_command(monkeypatch):
    from types import ModuleType, SimpleNamespace

    from accelerate.utils import DistributedType

    from finetune.config import RecipeError
    from finetune.training.distributed import check_engine

    fake = ModuleType("deepspeed")
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    fake.__version__ = "0.19.8"  # seen on an H200: its engine cannot broadcast CLIP's 0-dim logit_scale
    with pytest.raises(RecipeError, match=r"DeepSpeed 0\.19\.8 cannot train.*logit_scale.*deepspeed!=0\.19\.8"):
        check_engine(_deepspeed_accelerator(None))
    fake.__version__ = "0.19.7"
    check_engine(_deepspeed_accelerator(None))
    fake.__version__ = "0.19.8"
    check_engine(SimpleNamespace(distributed_type=DistributedType.FSDP))  # another engine: DeepSpeed not asked


def test_under_zero3_the_start_model_loads_whole_and_is_stretched_to_248():
    """accelerate registers its ZeRO-3 config with transformers (HfDeepSpeedConfig) whatever zero3_init_flag says;
    transformers would then build the model inside deepspeed.zero.Init (partitioned as made: the stretch saw a (0,)
    table on an H200). DeepSpeed is not installed here: a stand-in registers as a ZeRO-3 config the same way."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config
    from transformers.integrations.deepspeed import set_hf_deepspeed_config

    from finetune import load_model
    from finetune.training.distributed import load_whole_under_zero3

    class Zero3Config:  # what transformers reads of the registered HfDeepSpeedConfig
        def is_zero3(self) -> bool:
            return True

    registered = Zero3Config()
    set_hf_deepspeed_config(registered)
    plugin = DeepSpeedPlugin(hf_ds_config=dict(_ZERO3), zero3_init_flag=False)
    try:
        assert is_deepspeed_zero3_enabled()
        assert load_whole_under_zero3(_deepspeed_accelerator(plugin)) is True
        assert not is_deepspeed_zero3_enabled()
        model = load_model("random:tiny-clip", max_text_len=248)
        assert tuple(model.position_embedding().shape)[0] == 248
        assert load_whole_under_zero3(_deepspeed_accelerator(plugin)) is False  # nothing left to drop
    finally:
        unset_hf_deepspeed_config()


def test_the_nan_check_reads_each_process_s_own_part_of_the_weights():
    import torch
    from torch import nn

    from finetune.training.distributed import local_shards

    whole = nn.Parameter(torch.ones(3))
    zero3 = nn.Parameter(torch.empty(0))  # DeepSpeed ZeRO-3: the parameter is emptied, the partition is ds_tensor
    zero3.ds_tensor = torch.tensor([1.0, float("nan")])
    other = nn.Parameter(torch.empty(0))  # this process holds none of it
    other.ds_tensor = torch.empty(0)
    shards = local_shards([whole, zero3, other])
    assert [s.shape for s in shards] == [(3,), (2,)]
    assert torch.isnan(shards[1]).any()
    torch._foreach_norm(shards, float("inf"))  # no empty tensor left: the infinity norm has a value
