"""Config validation: every bad value is one ValueError at start-up that names its field."""

from __future__ import annotations

import math

import jax
import ml_collections
import pytest

from mtp_jax import config as config_lib
from mtp_jax import heads
from mtp_jax.config import validation
from mtp_jax.model import build_model, init_params, model_args, param_count


def _set_head_weights(c, weights):
  # ConfigDict is type-safe and the field is a string; Python lists need ignore_type().
  with c.ignore_type():
    c.loss.head_weights = weights


def _set(path, value):
  def mutate(c):
    *parents, leaf = path.split(".")
    node = c
    for p in parents:
      node = getattr(node, p)
    setattr(node, leaf, value)
  return mutate


# (id, mutation of a valid parallel n_future=2 tiny config, field the message must name,
#  another fragment it must contain).
BAD = [
    ("n_future_zero", _set("model.n_future", 0), "model.n_future", ">= 1"),
    ("n_future_negative", _set("model.n_future", -3), "model.n_future", ">= 1"),
    ("n_future_above_n_layers", _set("model.n_future", 5), "model.n_future", "n_layers"),
    ("seq_len_equals_n_future", lambda c: (_set("model.n_future", 4)(c),
                                           _set("data.seq_len", 4)(c)),
     "data.seq_len", "n_future"),
    ("seq_len_below_n_future", _set("data.seq_len", 1), "data.seq_len", "n_future"),
    ("n_heads_not_dividing_d_model", _set("model.n_heads", 3), "model.n_heads", "d_model"),
    ("n_kv_heads_not_dividing_n_heads", _set("model.n_kv_heads", 3), "model.n_kv_heads",
     "n_heads"),
    ("unknown_head_kind", _set("model.heads.kind", "medusa"), "model.heads.kind",
     "'parallel', 'projection', 'sequential'"),
    ("head_weights_too_short", lambda c: _set_head_weights(c, [1.0]), "loss.head_weights",
     "one weight per head"),
    ("head_weights_too_long", lambda c: _set_head_weights(c, [1.0, 0.5, 0.25]),
     "loss.head_weights", "one weight per head"),
    ("head_weights_unknown_name", _set("loss.head_weights", "harmonic"), "loss.head_weights",
     "'uniform'"),
    ("token_chunks_not_dividing_seq_len", _set("loss.token_chunks", 5), "loss.token_chunks",
     "divide data.seq_len"),
    ("token_chunks_zero", _set("loss.token_chunks", 0), "loss.token_chunks", ">= 1"),
    ("unknown_seq_preset", _set("model.heads.seq_preset", "medusa"), "model.heads.seq_preset",
     "'deepseek_v3'"),
    ("unknown_seq_concat", lambda c: (_set("model.heads.seq_preset", "")(c),
                                      _set("model.heads.seq_concat", "middle")(c)),
     "model.heads.seq_concat", "'emb_first'"),
    ("unknown_remat_policy", _set("model.remat_policy", "some"), "model.remat_policy",
     "'dots_saveable'"),
    ("unknown_fuse_projections", _set("model.fuse_projections", "yes"),
     "model.fuse_projections", "allowed: 'auto', 'on', 'off'"),
    ("negative_scan_unroll", _set("model.scan_unroll", -1), "model.scan_unroll", "0 (auto)"),
    ("negative_batch_slices", _set("train.batch_slices", -1), "train.batch_slices", "0 (auto)"),
    ("batch_slices_not_dividing_rows", _set("train.batch_slices", 3), "train.batch_slices",
     "divide the"),
    ("lambda_schedule_garbled", _set("loss.mtp_lambda_schedule", "0.3->0.1"),
     "loss.mtp_lambda_schedule", "'0.3@0,0.1@0.8'"),
    ("lambda_schedule_not_from_0", _set("loss.mtp_lambda_schedule", "0.3@0.1,0.1@0.8"),
     "loss.mtp_lambda_schedule", "start at 0"),
    ("lambda_schedule_falling_fractions",
     _set("loss.mtp_lambda_schedule", "0.3@0,0.2@0.8,0.1@0.5"),
     "loss.mtp_lambda_schedule", "rise"),
    ("lambda_schedule_fraction_1", _set("loss.mtp_lambda_schedule", "0.3@0,0.1@1"),
     "loss.mtp_lambda_schedule", "below 1"),
    ("lambda_schedule_negative", _set("loss.mtp_lambda_schedule", "linear:0.3,-0.1"),
     "loss.mtp_lambda_schedule", ">= 0"),
    ("lambda_schedule_three_ends", _set("loss.mtp_lambda_schedule", "cosine:0.3,0.2,0.1"),
     "loss.mtp_lambda_schedule", "'cosine:START,END'"),
    ("lambda_schedule_needs_deepseek", _set("loss.mtp_lambda_schedule", "linear:0.3,0.1"),
     "loss.mtp_lambda_schedule", "'deepseek'"),
    ("head_curriculum_above_1", _set("loss.head_curriculum", 1.5), "loss.head_curriculum",
     "in [0, 1]"),
    ("head_curriculum_one_head", lambda c: (_set("model.n_future", 1)(c),
                                            _set("loss.head_curriculum", 0.5)(c)),
     "loss.head_curriculum", "heads 2..n"),
    ("unknown_draft_objective", _set("loss.draft_objective", "lk"), "loss.draft_objective",
     "'kl_to_head1', 'tv'"),
    ("draft_objective_one_head", lambda c: (_set("model.n_future", 1)(c),
                                            _set("loss.draft_objective", "tv")(c)),
     "loss.draft_objective", "heads 2..n"),
]


@pytest.mark.parametrize("mutate,field,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_raises_naming_the_field(make_config, mutate, field, fragment):
  c = make_config("parallel", 2)
  validation.validate(c)  # valid before the mutation
  mutate(c)
  with pytest.raises(ValueError, match=rf"^config\.{field}: ") as err:
    validation.validate(c)
  assert fragment in str(err.value)


def test_base_and_tiny_configs_validate(make_config):
  validation.validate(config_lib.base_config())
  for kind in heads.KINDS:
    validation.validate(make_config(kind, 4))


def test_n_future_above_n_layers_is_fine_for_other_kinds(make_config):
  # Only parallel heads take their blocks from the trunk.
  for kind in ("projection", "sequential"):
    validation.validate(make_config(kind, 6))


def test_head_weight_list_of_right_length_validates(make_config):
  c = make_config("parallel", 2)
  _set_head_weights(c, [1.0, 0.5])
  validation.validate(c)


def test_head_weight_string_list_from_the_command_line(make_config, tmp_path):
  """ConfigDict is type-safe, so a per-head list is spelled "1,0.5" (what a CLI override is)."""
  c = make_config("parallel", 2)
  c.loss.head_weights = "1,0.5"
  validation.validate(c)
  from mtp_jax.loss import head_weights
  assert head_weights(c).tolist() == [1.0, 0.5]
  c.loss.head_weights = "1,0.5,0.25"
  with pytest.raises(ValueError, match="config.loss.head_weights: .*one weight per head"):
    validation.validate(c)


def test_custom_seq_fields_conflicting_with_preset_are_an_error(make_config):
  c = make_config("sequential", 3)
  c.model.heads.seq_concat = "hidden_first"  # but seq_preset is still "deepseek_v3"
  with pytest.raises(ValueError, match="config.model.heads.seq_preset"):
    validation.validate(c)
  c.model.heads.seq_preset = ""
  validation.validate(c)
  assert c.model.heads.seq_concat == "hidden_first"


@pytest.mark.parametrize("preset", sorted(heads.SequentialHeads.presets))
def test_seq_preset_sets_its_three_fields(make_config, preset):
  """validate checks and leaves the config as it is; the model reads the preset's fields;
  validation.resolve (the entry points' step) writes them into the config."""
  c = make_config("sequential", 3)
  c.model.heads.seq_preset = preset
  before = c.to_dict()
  validation.validate(c)
  assert c.to_dict() == before
  fields = heads.SequentialHeads.presets[preset]
  assert sorted(fields) == ["seq_concat", "seq_output_norm", "seq_trunk_state"]
  args = model_args(c)
  assert {f: getattr(args, f) for f in fields} == fields and c.to_dict() == before
  assert validation.resolve(c) is c
  assert {f: c.model.heads[f] for f in fields} == fields


def test_empty_seq_preset_keeps_custom_fields(make_config):
  c = make_config("sequential", 3)
  c.model.heads.seq_preset = ""
  c.model.heads.seq_concat, c.model.heads.seq_trunk_state = "hidden_first", "pre_norm"
  c.model.heads.seq_output_norm = "shared"
  validation.validate(c)
  assert (c.model.heads.seq_concat, c.model.heads.seq_trunk_state,
          c.model.heads.seq_output_norm) == ("hidden_first", "pre_norm", "shared")


def test_default_config_size():
  """The base config builds; a 6-layer d_model 256 byte-level model is a few million params."""
  model = build_model(config_lib.base_config())
  shapes = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
  assert 4e6 < param_count(shapes) < 6e6


def _float_fields(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every float field of the config tree, dotted ("optim.lr")."""
  out = []
  for key, value in c.items():
    if isinstance(value, ml_collections.ConfigDict):
      out += _float_fields(value, f"{prefix}{key}.")
    elif isinstance(value, float):
      out.append(prefix + key)
  return out


FLOAT_FIELDS = _float_fields(config_lib.base_config())


def test_every_float_field_has_a_range():
  assert len(FLOAT_FIELDS) >= 12, FLOAT_FIELDS  # the walk finds them
  assert sorted(FLOAT_FIELDS) == sorted(config_lib.FLOAT_RANGES)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_float_is_an_error(make_config, field, value):
  c = make_config("parallel", 2)
  validation.validate(c)
  _set(field, value)(c)
  with pytest.raises(ValueError, match=rf"^config\.{field}: must be a finite number .*, got "
                     rf"-?(nan|inf)$"):
    validation.validate(c)


# Values just outside each range (worked out from what the code does with them), and the
# edges that are allowed.
OUT_OF_RANGE = [("optim.lr", 0.0), ("optim.lr", -1e-3), ("optim.b1", 1.0), ("optim.b2", -0.1),
                ("optim.eps", 0.0), ("optim.min_lr_ratio", 1.5), ("optim.weight_decay", -0.1),
                ("optim.grad_clip", -1.0), ("loss.geometric_decay", 0.0),
                ("loss.geometric_decay", 1.01), ("loss.mtp_lambda", -0.3), ("loss.z_loss", -1e-4),
                ("model.norm_eps", 0.0), ("model.rope_theta", -1.0)]
IN_RANGE = [("optim.b1", 0.0), ("optim.min_lr_ratio", 0.0), ("optim.min_lr_ratio", 1.0),
            ("optim.grad_clip", 0.0), ("optim.weight_decay", 0.0), ("loss.geometric_decay", 1.0),
            ("loss.mtp_lambda", 0.0), ("loss.z_loss", 0.0)]


@pytest.mark.parametrize("field,value", OUT_OF_RANGE)
def test_float_out_of_range_is_an_error(make_config, field, value):
  c = make_config("parallel", 2)
  _set(field, value)(c)
  with pytest.raises(ValueError, match=rf"^config\.{field}: must be a finite number "):
    validation.validate(c)


def test_float_range_edges_validate(make_config):
  for field, value in IN_RANGE:
    c = make_config("parallel", 2)
    _set(field, value)(c)
    validation.validate(c)


def test_head_weight_list_must_be_finite(make_config):
  c = make_config("parallel", 2)
  c.loss.head_weights = "1,nan"
  with pytest.raises(ValueError, match=r"^config\.loss\.head_weights: .*finite"):
    validation.validate(c)


def test_nan_learning_rate_message():
  c = config_lib.base_config()
  c.optim.lr = float("nan")
  with pytest.raises(ValueError) as err:
    validation.validate(c)
  assert str(err.value) == "config.optim.lr: must be a finite number > 0, got nan"
