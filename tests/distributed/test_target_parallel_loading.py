"""Shard-only loading of a tensor-parallel target (flashdraft/distributed/shard_loading.py,
docs/distributed.md "Target tensor parallelism"): each rank's parameters, read as slices of the
checkpoint, equal bitwise the shards the whole-model load cuts; buffers equal a normal load's; tied
embeddings stay tied; a 2-file checkpoint; a rank never reads a whole split weight; and the fallback to the
whole-model load says why.

One rank of a 2- or 4-rank group is played in this process with torch's fake process group: loading needs
no collective, and the rank's own shard is what is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from flashdraft.distributed import shard_loading
from flashdraft.distributed.shard_loading import ShardLoadUnsupported, checkpoint_names, empty_model
from flashdraft.distributed.target_parallel import load_group_target
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import build_model, save_tiny_target, tiny_config

LAYER_IDS = [0, 2, 5]
NOTICE = "loading the whole target on each rank of its group"


@pytest.fixture
def fake_rank():
    """Start this process as rank `rank` of a fake world of `world` ranks (no real collectives)."""

    def start(rank: int, world: int = 2) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _assert_same_as_whole_load(path, capsys, dtype=torch.bfloat16):
    """Loads both ways on this rank; returns the shard-loaded target after checking it bitwise."""
    new = load_group_target(path, LAYER_IDS, torch.device("cpu"), 2, dtype=dtype)
    assert NOTICE not in capsys.readouterr().out  # the shard-only path was taken
    old = load_group_target(path, LAYER_IDS, torch.device("cpu"), 2, dtype=dtype, whole=True)
    assert type(new.model) is type(old.model)
    assert new.model.config._attn_implementation == old.model.config._attn_implementation
    got = dict(new.model.named_parameters(remove_duplicate=False))
    want = dict(old.model.named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys()
    assert any(isinstance(p, DTensor) for p in got.values())
    for name, param in got.items():
        assert type(param) is type(want[name]) and param.dtype == want[name].dtype, name
        if isinstance(param, DTensor):
            assert param.placements == want[name].placements and param.shape == want[name].shape, name
        assert torch.equal(_local(param), _local(want[name])), name
    buffers, wanted = dict(new.model.named_buffers()), dict(old.model.named_buffers())
    assert buffers.keys() == wanted.keys() and buffers  # RoPE's inv_freq: computed, not read
    for name, buffer in buffers.items():
        assert buffer.dtype == wanted[name].dtype and torch.equal(buffer, wanted[name]), name
    return new


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("rank", [0, 1])
def test_shard_loading_equals_the_cut_of_the_whole_load(target_dirs, fake_rank, capsys, kind, rank):
    fake_rank(rank)
    _assert_same_as_whole_load(target_dirs[kind], capsys)


def test_tied_embeddings_the_lm_head_is_the_embedding(tmp_path, fake_rank, capsys):
    path = save_tiny_target(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    fake_rank(1)
    target = _assert_same_as_whole_load(path, capsys, dtype=torch.float32)
    assert target.lm_head_weight is target.embed_weight  # one tensor, as a normal load ties them


def test_a_two_file_checkpoint_is_read_through_its_index(tmp_path, fake_rank, capsys):
    path = tmp_path / "two-files"
    build_model(tiny_config("qwen3_5"), seed=3).save_pretrained(path, max_shard_size="400KB")
    files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) >= 2
    fake_rank(0)
    _assert_same_as_whole_load(path, capsys, dtype=torch.float32)


def test_a_rank_reads_only_its_shard_of_every_split_weight(target_dirs, fake_rank, capsys, monkeypatch):
    """What the rank reads from the checkpoint: for a split weight exactly its shard (never the whole),
    in all exactly its parameters' bytes, about half of the split part of the model plus the replicated
    part."""
    reads: dict[str, torch.Size] = {}
    real_read = shard_loading._Reader.read

    def counting_read(self, name, *args):
        tensor = real_read(self, name, *args)
        reads[name] = tensor.shape
        return tensor

    monkeypatch.setattr(shard_loading._Reader, "read", counting_read)
    fake_rank(1)
    target = load_group_target(target_dirs["qwen3_5"], LAYER_IDS, torch.device("cpu"), 2, dtype=torch.float32)
    params = dict(target.model.named_parameters())
    names = checkpoint_names(empty_model(Path(target_dirs["qwen3_5"]), torch.float32), set(reads))
    split = {names[n]: p for n, p in params.items() if isinstance(p, DTensor)}
    assert split
    for source, param in split.items():
        assert reads[source] == param.to_local().shape != param.shape, source
    read_bytes = sum(shape.numel() for shape in reads.values()) * 4
    held_bytes = sum(_local(p).numel() for p in params.values()) * 4
    whole_bytes = sum(p.numel() for p in params.values()) * 4
    split_bytes = sum(p.numel() for p in split.values()) * 4
    assert read_bytes == held_bytes == whole_bytes - split_bytes // 2


def test_checkpoint_names_plain_wrapped_and_refused():
    model = empty_model_from_config("qwen3_5")
    keys = set(model.state_dict())
    assert checkpoint_names(model, keys) == {k: k for k in keys}
    wrapped = {k.replace("model.", "model.language_model.", 1) for k in keys}
    names = checkpoint_names(model, wrapped | {"model.visual.patch_embed.weight"})
    assert names["model.norm.weight"] == "model.language_model.norm.weight"
    assert names["lm_head.weight"] == "lm_head.weight"
    with pytest.raises(ShardLoadUnsupported, match=r"no tensor named 'model.norm.weight'"):
        checkpoint_names(model, keys - {"model.norm.weight"})
    # Qwen3 has no wrapper: transformers would not read wrapped names as its own, so neither do we.
    plain = empty_model_from_config("qwen3")
    wrapped = {k.replace("model.", "model.language_model.", 1) for k in plain.state_dict()}
    with pytest.raises(
        ShardLoadUnsupported, match=r"transformers loads the checkpoint's 'model.language_model"
    ):
        checkpoint_names(plain, wrapped)


def empty_model_from_config(kind: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind))


def test_a_target_without_safetensors_is_refused_before_any_rank_loads_it(tmp_path, fake_rank):
    """Pickled weights are never loaded (issue 28): sharded loading refuses them as a single process does,
    in one line that says how to convert them, instead of falling back to loading the whole pickle."""
    path = save_tiny_target(tmp_path / "bin", "qwen3")
    state = build_model(tiny_config("qwen3")).state_dict()
    torch.save(state, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    fake_rank(0)
    with pytest.raises(
        FlashdraftError, match=r"only pytorch_model.bin \(a pickle.*convert them to safetensors"
    ):
        load_group_target(path, LAYER_IDS, torch.device("cpu"), 2, dtype=torch.float32)


def test_a_broken_index_is_one_clear_error_naming_the_file_and_line(tmp_path, fake_rank):
    path = save_tiny_target(tmp_path / "broken", "qwen3")
    (path / "model.safetensors.index.json").write_text('{"weight_map":\n  {"a": }\n}')
    fake_rank(0)
    with pytest.raises(FlashdraftError, match=r"model.safetensors.index.json:2: not valid JSON"):
        load_group_target(path, LAYER_IDS, torch.device("cpu"), 2, dtype=torch.float32)
    (path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "gone.safetensors"}}'
    )
    with pytest.raises(FlashdraftError, match=r"index.json: names gone.safetensors, which is not in"):
        load_group_target(path, LAYER_IDS, torch.device("cpu"), 2, dtype=torch.float32)


class _Allocations(TorchDispatchMode):
    """Records the bytes of every CPU tensor an operation allocates (an output whose storage is new; not
    safetensors' memory map of the file, which comes in through `set_` and reads nothing by itself)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.set_.source_Storage:
            return out
        inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs))}
        for t in pytree.tree_leaves(out):
            if _storage(t) not in (None, *inputs):
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def _storage(t) -> int | None:
    """The address of a plain CPU tensor's memory (None for anything else: wrappers hold none)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or not t.numel():
        return None
    return t.untyped_storage().data_ptr()


def test_a_rank_allocates_its_shard_plus_the_replicated_part_not_the_whole_model(target_dirs, fake_rank):
    """Everything the load allocates, added up (a bound on its peak), is this rank's parameters plus the
    few small computed buffers: half of the split weights and the replicated part."""
    fake_rank(0)
    with _Allocations() as allocations:
        target = load_group_target(
            target_dirs["qwen3_5"], LAYER_IDS, torch.device("cpu"), 2, dtype=torch.float32
        )
    params = list(target.model.parameters())
    split = [p for p in params if isinstance(p, DTensor)]
    held = sum(_local(p).numel() for p in params) * 4
    buffers = sum(b.numel() for b in target.model.buffers()) * 4
    whole = sum(p.numel() for p in params) * 4
    assert held == whole - sum(p.numel() for p in split) * 4 // 2
    assert held <= sum(allocations.sizes) <= held + 8 * buffers
    # Every allocation beyond the buffers' small ones is one of the rank's parameters, made once, at its
    # local size: no whole split weight is ever allocated, not even for a moment.
    large = sorted(size for size in allocations.sizes if size > 8 * buffers)
    assert large == sorted(_local(p).numel() * 4 for p in params if _local(p).numel() * 4 > 8 * buffers)


def test_a_gguf_target_takes_the_whole_model_path_saying_why(target_dirs, fake_rank, capsys, monkeypatch):
    """A GGUF target is converted to a whole model directory first (docs/real-target.md); its load stays the
    whole-model one. (The conversion itself is stood in for: the tiny target plays the converted copy.)"""
    from flashdraft.distributed import target_parallel

    monkeypatch.setattr(target_parallel, "is_gguf_target", lambda path: True)
    monkeypatch.setattr(target_parallel, "target_directory", lambda path: Path(path))
    fake_rank(0)
    load_group_target(target_dirs["qwen3"], LAYER_IDS, torch.device("cpu"), 2, dtype=torch.float32)
    assert (
        f"{NOTICE} and cutting it there, not only each rank's shard: a GGUF target" in capsys.readouterr().out
    )
