"""The disk cache of what heads="auto" measured (mtp_jax.decoding.timing_cache): a second
session on the same machine and model decides without probing or timing and picks the same;
a corrupt file is a warning, not a crash; the key follows batch and model shape. Every test
uses its own tmp directory (MTP_JAX_CACHE set by monkeypatch), never the user's cache."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
import pytest
from conftest import force_costs, random_params, tiny_config

from mtp_jax.decoding import costmodel, timing_cache
from mtp_jax.decoding import decode as decode_lib
from mtp_jax.decoding import probes as probes_lib
from mtp_jax.decoding import session as session_lib
from mtp_jax.model import build_model

PAD = 59
PROMPTS = [[3, 4, 5], [9, 4, 12, 6, 33, 3]]


@pytest.fixture(scope="module")
def model():
  c = tiny_config("parallel", n_future=3)
  c.model.max_len = 64
  m = build_model(c)
  return m.args, random_params(m, seed=3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv(timing_cache.ENV, str(tmp_path))
  return timing_cache.default()


@pytest.fixture
def counted(monkeypatch):
  """Counts probes run and windows timed (forward times and the probes' cycles faked: cheap
  windows, so a chain can win; with the probes' real cycles the choice was the clock's)."""
  calls = {"probes": 0, "windows": 0}

  def count(what):
    def cost(t):
      calls[what] += 1
      return 1.0 + 0.01 * t.k
    return cost

  force_costs(monkeypatch, count("windows"), count("probes"))
  return calls


def test_default_root_follows_the_env(tmp_path, monkeypatch):
  monkeypatch.setenv(timing_cache.ENV, str(tmp_path))
  assert timing_cache.default().root == os.path.join(str(tmp_path), "timings")
  monkeypatch.setenv(timing_cache.ENV, "off")
  assert timing_cache.default() is None


def test_a_warm_cache_decides_without_probing(model, cache, counted):
  args, params = model
  kw = dict(max_new_tokens=16, k="auto", tree=None, eos_id=-1, pad_id=PAD)
  first = decode_lib.resolve(params, args, PROMPTS, disk=cache, **kw)
  # the chain of all heads, plain, and the best speculative candidate (near the bar) on its own
  # loop, beside plain decoding again
  assert counted["probes"] == 4 and counted["windows"] > 0
  assert [row["heads"] for row in first[2]["table"] if row["own_loop"]] == [2, 3]
  assert first[2]["measured_seconds"] > 0 and first[2]["cache"] == cache.root
  seen = dict(counted)
  second = decode_lib.resolve(params, args, PROMPTS, disk=timing_cache.default(), **kw)
  assert counted == seen  # nothing probed or timed: all read from the files
  assert second[:2] == first[:2] and second[2]["measured_seconds"] == 0
  assert second[2]["table"] == first[2]["table"]
  # Other params of the same shape accept differently: probed again; the timings are kept.
  shifted = jax.tree.map(lambda x: x * 1.01, params)
  assert timing_cache.fingerprint(shifted) != timing_cache.fingerprint(params)
  decode_lib.resolve(shifted, args, PROMPTS, disk=cache, **kw)
  assert counted["probes"] == seen["probes"] + 4 and counted["windows"] == seen["windows"]


def test_sampled_tree_auto_reads_its_chain_probe_from_a_warm_cache(model, cache, counted):
  """Sampled tree=auto probes the chain of all heads beside the union tree: a second session
  reads that probe from the disk too, and decides the same without probing or timing."""
  args, params = model
  kw = dict(max_new_tokens=16, k="auto", tree="auto", eos_id=-1, pad_id=PAD, temperature=1.0,
            seed=2)
  first = decode_lib.resolve(params, args, PROMPTS, disk=cache, **kw)
  assert first[2]["chain_probe"]["tree"] == costmodel.chain(args.n_future).name
  seen = dict(counted)
  second = decode_lib.resolve(params, args, PROMPTS, disk=timing_cache.default(), **kw)
  assert counted == seen and second[:2] == first[:2] and second[2]["measured_seconds"] == 0
  assert second[2]["chain_probe"] == first[2]["chain_probe"]
  assert second[2]["table"] == first[2]["table"]


def test_a_corrupt_file_is_ignored_with_a_warning(model, cache, counted, caplog):
  args, params = model
  kw = dict(max_new_tokens=16, k="auto", tree=None, eos_id=-1, pad_id=PAD)
  first = decode_lib.resolve(params, args, PROMPTS, disk=cache, **kw)
  names = sorted(os.listdir(cache.root))
  assert names and all(n.endswith(".json") for n in names)
  for n in names:  # every entry broken: half a JSON
    with open(os.path.join(cache.root, n), "w") as f:
      f.write('{"key": ')
  seen = dict(counted)
  with caplog.at_level(logging.WARNING):
    again = decode_lib.resolve(params, args, PROMPTS, disk=cache, **kw)
  assert "timing cache: ignoring" in caplog.text
  assert counted["probes"] == seen["probes"] + 4 and again[:2] == first[:2]
  third = decode_lib.resolve(params, args, PROMPTS, disk=cache, **kw)  # rewritten: read again
  assert third[2]["measured_seconds"] == 0
  key = {"what": "x"}
  cache.put(key, 1.5)
  with open(cache.path(key), "w") as f:
    f.write('{"key": {"what": "y"}, "value": 2.0}')  # another key's entry under this name
  assert cache.get(key) is None


def test_the_key_changes_with_batch_and_model_shape(model, cache):
  args, params = model
  s = session_lib.Session(params, args, disk=cache)
  k1 = s._key("forward", batch=1, context=40, window="1,1", reps=11)
  assert k1 == s._key("forward", batch=1, context=40, window="1,1", reps=11)
  assert cache.path(k1) != cache.path(s._key("forward", batch=8, context=40, window="1,1",
                                             reps=11))
  wider = dataclasses.replace(args, d_model=args.d_model * 2)
  assert timing_cache.model_shape(wider) != timing_cache.model_shape(args)
  k2 = session_lib.Session(params, wider, disk=cache)._key("forward", batch=1, context=40,
                                                           window="1,1", reps=11)
  assert cache.path(k2) != cache.path(k1)
  assert timing_cache.prompt_bucket(1) == 32 and timing_cache.prompt_bucket(33) == 64
  assert timing_cache.fingerprint(params) == timing_cache.fingerprint(
      jax.tree.map(np.array, params))  # a copy of the same weights


def test_evaluation_decides_from_the_cache_and_says_so(model, cache, counted):
  """pass@k's decoding (evaluate, tasks_eval) keeps auto's probes in the cache: a second run
  probes nothing, and both print what deciding did and a line per batch."""
  from types import SimpleNamespace

  from mtp_jax.evaluation import passk
  args, params = model
  loaded = SimpleNamespace(model=SimpleNamespace(args=args), params=params,
                           tokenizer=SimpleNamespace(pad_id=PAD, eos_id=-1))
  kw = dict(num_samples=1, temperature=0.0, top_p=1.0, top_k=0, seed=0, mode="speculative",
            max_new_tokens=8, batch_size=2, heads="auto")
  runs = []
  for _ in range(2):
    lines = []
    gen = passk.generate_completions(loaded, PROMPTS * 2, progress=lines.append, **kw)
    runs.append((dict(counted), lines, gen.tokens))
  (after_first, first, tokens1), (after_second, second, tokens2) = runs
  assert after_first["probes"] == 4 and after_second == after_first  # nothing probed again
  assert [t.tolist() for t in tokens1] == [t.tolist() for t in tokens2]
  assert first[0].startswith("auto: deciding for batch 3, prompt width 56, 8 new tokens")
  assert f"read from {cache.root} where kept" in first[0]
  assert first[1].startswith("auto: ") and "deciding took" in first[1]
  assert first[2].startswith("batch 1/2: 2/4 rows,") and first[3].startswith("batch 2/2: 4/4")
  assert "0.0s of it measured" in second[1] and "0.0s of it measured" not in first[1]


def test_probes_time_a_short_run_against_the_whole_call(model, monkeypatch):
  """A probe times a short run (4 cycles of a speculative window, 12 plain steps, at most half
  the call) against the whole call: short windows (4 and 12 cycles) were within a call's jitter
  at batch 1 (docs/decoding.md). Windows probed together run interleaved; the acceptance is the
  whole call's."""
  assert session_lib.costmodel.probe_lengths(4, 128) == (4, None)
  assert session_lib.costmodel.probe_lengths(1, 128) == (12, None)
  assert session_lib.costmodel.probe_lengths(3, 12) == (2, None)
  assert session_lib.costmodel.probe_lengths(1, 2) == (1, None)
  args, params = model
  seen, real = [], session_lib.Decoder.__call__

  def call(self, *a, max_cycles=None, **kw):
    seen.append(max_cycles)
    return real(self, *a, max_cycles=max_cycles, **kw)

  monkeypatch.setattr(session_lib.Decoder, "__call__", call)
  s = session_lib.Session(params, args)
  (plain, seconds, fixed), (chain, *_) = s._run_probes(
      PROMPTS, [(None, 1), (None, 3)], max_new_tokens=32, sampling=False, eos_id=-1, pad_id=PAD,
      sample_kw={})
  # a short run of each (warm-up), then PROBE_ROUNDS rounds of both windows' two lengths
  assert seen == [12, 4] + [12, None, 4, None] * session_lib.PROBE_ROUNDS, seen
  assert seconds > 0 and fixed >= 0, (seconds, fixed)
  assert plain.lengths.min() == chain.lengths.min() == 32, (plain.lengths, chain.lengths)


def test_a_window_probed_later_runs_beside_plain_decoding_and_takes_its_scale(model, cache,
                                                                            monkeypatch):
  """A window probed after the decision's first probe (its pick, checked on its own loop) runs
  beside plain decoding again: on a machine now 2x slower, its cycle and fixed part are halved
  onto the scale of the plain decoding it will be weighed against; the disk keeps them so."""
  args, params = model
  ran = []

  def run_probes(self, prompts, windows, **kw):
    ran.append(windows)
    r = probes_lib.Probe(np.ones((1, 2), np.int64), 3, 1.5)
    return [(r, 2.0 if k == 1 else 3.0, 1.0) for _, k in windows]

  monkeypatch.setattr(session_lib.Session, "_run_probes", run_probes)
  s = session_lib.Session(params, args, disk=cache)
  kw = dict(max_new_tokens=16, sampling=False, eos_id=-1, pad_id=PAD, sample_kw={})
  (_, cycle, fixed), = s._probes(PROMPTS, [(None, 3)], beside=(1.0, 0.2), **kw)
  assert ran == [[(None, 3), (None, 1)]] and (cycle, fixed) == (1.5, 0.5)
  assert s._probes(PROMPTS, [(None, 3)], beside=(1.0, 0.2), **kw)[0][1:] == (1.5, 0.5)
  assert len(ran) == 1  # from the disk, as scaled
  (_, alone, _), = s._probes(PROMPTS, [(None, 2)], **kw)  # without `beside`: as measured
  assert ran[-1] == [(None, 2)] and alone == 3.0


def test_a_window_missing_from_the_disk_joins_what_the_disk_kept(model, cache, counted):
  """A later session asks for a window the disk kept and one it did not: only the new one is
  timed, beside the kept one (its reference), and put on the kept one's scale."""
  args, params = model
  chain = costmodel.chain
  first = session_lib.Session(params, args, disk=cache)
  kept = first.forward_times([chain(1), chain(2)], batch=2, context=8)
  assert counted["windows"] == 2
  later = session_lib.Session(params, args, disk=timing_cache.default())
  got = later.forward_times([chain(1), chain(3)], batch=2, context=8)
  assert counted["windows"] == 4  # chain(3), and chain(1) again as the reference
  assert got == {chain(1): kept[chain(1)], chain(3): pytest.approx(1.03)}
