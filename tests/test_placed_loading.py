"""Placement-first loading from each source: tensors go straight to their final memory kind.

Memory is measured from `jax.live_arrays()`, summed by memory kind, after every tensor the loader
places (its `observe` hook) and before the load starts; the difference is what the load holds. The
loaded model must equal the reference arrangement (the whole model built on the device by
`model_from_params`, then cut into groups by `GroupedTransformer` / `offload_tail`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtier import checkpoint, offload
from jaxtier.checkpoint import hf, placed
from jaxtier.checkpoint.params import model_from_params
from jaxtier.model import GroupedTransformer
from conftest import fixture_path
from test_checkpoint import write_tiny_gguf
from test_model_tiny import full_logits


def live_bytes_by_kind() -> dict[str, int]:
  return offload.bytes_by_memory_kind(jax.live_arrays())


class Recorder:
  """Live bytes per memory kind after each placed tensor, relative to the start."""

  def __init__(self):
    self.start = live_bytes_by_kind()
    self.samples: list[tuple[str, dict[str, int]]] = []
    self.device_shapes: list[tuple[int, ...]] = []

  def __call__(self, name: str, array: jax.Array) -> None:
    now = live_bytes_by_kind()
    self.samples.append((name, {k: v - self.start.get(k, 0) for k, v in now.items()}))
    if array.sharding.memory_kind == offload.DEVICE:
      self.device_shapes.append(array.shape)

  def peak(self, kind: str) -> int:
    return max(s.get(kind, 0) for _, s in self.samples)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """The tiny Llama as a Hugging Face directory, an Orbax directory and a GGUF file (F32 tensors
  and Q8_0/F16 ones, so each source has its own reference parameters)."""
  hf_dir = fixture_path("tiny_llama")
  config = hf.read_config(hf_dir)
  params = hf.read_params(hf_dir, config)
  orbax_dir = str(tmp_path_factory.mktemp("orbax") / "tiny")
  loaded = checkpoint.load(hf_dir)
  checkpoint.save_orbax(orbax_dir, loaded.model, loaded.tokenizer)
  gguf_path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  _, gguf_params = write_tiny_gguf(gguf_path)
  return config, {"hf": (hf_dir, params), "orbax": (orbax_dir, params),
                  "gguf": (gguf_path, gguf_params)}


LAYOUTS = {  # (offloaded tail layers, head execution)
    "offload2_unrolled": (2, "unrolled"),
    "offload1_scan": (1, "scan"),
    "resident_unrolled": (0, "unrolled"),
    "resident_scan": (0, "scan"),
}


@pytest.mark.parametrize("kind", ["hf", "orbax", "gguf"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_loading_places_each_tensor_once_in_its_final_memory_kind(sources, kind, layout_name):
  config, by_kind = sources
  path, params = by_kind[kind]
  tail, head = LAYOUTS[layout_name]
  layout = placed.Layout.of(config.num_layers, tail, 1, head)
  recorder = Recorder()
  loaded = checkpoint.load(path, "float32", layout, observe=recorder)
  assert loaded.kind == kind
  state = nnx.state(loaded.model)
  final = offload.bytes_by_memory_kind(state)
  layer_bytes = config.layer_param_count * 4
  assert final.get(offload.PINNED_HOST, 0) == tail * layer_bytes
  # Device-kind bytes never exceed the resident share (plus one layer, the bound the design
  # allows; placing each tensor straight into its final buffer needs none of it).
  assert recorder.peak(offload.DEVICE) <= final[offload.DEVICE] + layer_bytes
  assert recorder.peak(offload.DEVICE) <= final[offload.DEVICE]
  # The tail never exists in device memory: no device array has a tail stack's shape, and host
  # bytes grow only as tail tensors are placed.
  tail_shapes = {(tail,) + a.shape[1:] for a in jax.tree.leaves(state)
                 if a.sharding.memory_kind == offload.PINNED_HOST}
  assert not tail_shapes & set(recorder.device_shapes)
  assert recorder.peak(offload.PINNED_HOST) <= tail * layer_bytes
  # Same model as the reference arrangement of the whole model loaded on the device (with the
  # source's own config: GGUF metadata carries its own norm epsilon).
  reference = model_from_params(loaded.model.config, params, jnp.float32)
  if tail:
    reference = offload.offload_tail(reference, tail, 1, head)
  elif head == "unrolled":
    reference = GroupedTransformer(reference, [(config.num_layers, "unrolled")])
  ids = jnp.arange(13, dtype=jnp.int32)[None] * 11 % config.vocab_size
  np.testing.assert_allclose(full_logits(loaded.model, ids), full_logits(reference, ids),
                             atol=1e-5, rtol=0)


def test_orbax_restores_whole_tensors_straight_into_their_shardings(sources, monkeypatch):
  _, by_kind = sources
  placed_paths = []
  original = checkpoint.orbax_io.OrbaxSource.place

  def spy(self, path, target, dtype):
    array = original(self, path, target, dtype)
    assert array.sharding == target
    placed_paths.append(path)
    return array

  monkeypatch.setattr(checkpoint.orbax_io.OrbaxSource, "place", spy)
  checkpoint.load(by_kind["orbax"][0], "float32", placed.Layout.of(3, 2, 1, "unrolled"))
  assert {("embed", "embedding"), ("final_norm", "scale"), ("lm_head",)} <= set(placed_paths)
  assert not any(p[0] == "layers" for p in placed_paths)  # layer groups are slices: read, then put
  placed_paths.clear()
  checkpoint.load(by_kind["orbax"][0], "float32")  # one stacked scan: every tensor is whole
  assert ("layers", "q_proj", "kernel") in placed_paths


def test_layout_rejects_groups_that_do_not_cover_the_model(sources):
  config, by_kind = sources
  with pytest.raises(ValueError, match=r"cover 2 layers; the model has 3"):
    checkpoint.load(by_kind["hf"][0], "float32", placed.Layout(((2, "scan"),)))
  with pytest.raises(ValueError, match="expected positive sizes and modes"):
    placed.Layout(((3, "sideways"),))
  assert placed.Layout.of(config.num_layers, 2, 1, "unrolled").groups == (
      (1, "unrolled"), (2, "offload"))
