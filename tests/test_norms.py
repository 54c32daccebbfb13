"""The final-norm table: resolution, validation, CLI, and numeric truth against transformers."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from chatgrammar.errors import NormError
from chatgrammar.core.norms import (FinalNorm, NormKind, apply_norm, build_final_norm,
                               explain_final_norm, final_norm_kind, load_norms, norms_path,
                               read_config, resolve_final_norm, validate_norms)

ROOT = Path(__file__).resolve().parent.parent
TABLE = load_norms()


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# The table itself
# ---------------------------------------------------------------------------------------------

def test_bundled_norms_file_is_found_and_valid():
    assert norms_path().name == "norms.yaml"
    assert norms_path().is_file()
    assert validate_norms() == []


@pytest.mark.parametrize("model_type", [
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2",
    "kimi_linear", "gemma2", "gemma3_text", "gemma4_text", "minimax_m3_vl_text", "gpt_oss",
    "nemotron_h", "phi3", "glm4_moe",
    # the families added in session 2 (Granite, Cohere, Falcon-H1, LFM2, EXAONE, Hunyuan, …)
    "granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "cohere2", "falcon_h1",
    "apertus", "lfm2", "lfm2_moe", "olmoe", "exaone", "exaone_moe", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "ernie4_5", "glm", "phimoe", "nemotron", "bitnet", "helium", "arcee",
    "dots1", "seed_oss",
])
def test_required_backbones_are_in_the_table(model_type):
    assert final_norm_kind(model_type) in TABLE.kinds


@pytest.mark.parametrize("model_type, kind", [
    ("llama", "rmsnorm"),
    ("kimi_k2", "rmsnorm"),        # DeepseekV3RMSNorm
    ("kimi_linear", "rmsnorm"),
    ("gemma2", "rmsnorm_one_plus"),
    ("gemma3_text", "rmsnorm_one_plus"),
    ("minimax_m3_vl_text", "rmsnorm_one_plus"),
    ("gemma4_text", "rmsnorm_fp32_mul"),  # plain weight, NOT 1 + w
    ("nemotron_h", "rmsnorm_fp32_mul"),
    ("gpt_oss", "rmsnorm_fp32_weight"),
    ("phi", "layernorm"),
    ("cohere", "layernorm_no_bias"),
    ("cohere2", "layernorm_no_bias"),
    ("phimoe", "layernorm"),               # nn.LayerNorm with a bias, eps from rms_norm_eps
    ("nemotron", "layernorm_one_plus"),    # LayerNorm1P: bias, 1 + w rounded to the model dtype
    ("helium", "rmsnorm_fp32_mul"),
    ("olmoe", "rmsnorm"),                  # Llama-style, unlike OLMo 2/3
    ("granitemoehybrid", "rmsnorm"),
    ("falcon_h1", "rmsnorm"),
    ("lfm2", "rmsnorm"),
])
def test_kinds_of_notable_backbones(model_type, kind):
    # (the facts of transformers 5.24; nemotron_h's differs before 5.18, see below)
    assert final_norm_kind(model_type, transformers_version="5.24.0") == kind


def test_gemma4_is_not_one_plus_and_gpt_oss_has_its_own_kind():
    assert TABLE.kinds[final_norm_kind("gemma4_text")].offset == 0
    assert TABLE.kinds[final_norm_kind("gemma3_text")].offset == 1
    gpt_oss_kind = final_norm_kind("gpt_oss")
    assert TABLE.kinds[gpt_oss_kind].weight_dtype == "float32"
    assert [b for b in TABLE.backbones.values() if b.kind == gpt_oss_kind] == [
        TABLE.backbones["gpt_oss"]]


@pytest.mark.parametrize("outer", ["kimi_k3", "kimi_k25", "gemma3", "gemma4", "minimax_m3_vl",
                                   "llava_next", "granite_docling", "cohere2_vision",
                                   "aya_vision", "lfm2_vl", "exaone4_5", "hunyuan_vl"])
def test_outer_wrapper_types_are_not_keys(outer):
    assert final_norm_kind(outer) is None
    assert outer in TABLE.outer_types


def test_every_backbone_names_its_source():
    for entry in TABLE.backbones.values():
        assert len(entry.source) > 20, entry.model_type


def test_eps_attribute_of_nemotron_h():
    assert TABLE.backbones["nemotron_h"].eps == ("layer_norm_epsilon",)
    assert TABLE.backbones["nemotron_h"].transformers["module"] == "norm_f"


def test_final_norm_modules_and_eps_names_that_are_not_norm_and_rms_norm_eps():
    assert TABLE.backbones["lfm2"].transformers["module"] == "embedding_norm"
    assert TABLE.backbones["lfm2"].eps == ("norm_eps",)
    assert TABLE.backbones["falcon_h1"].transformers["module"] == "final_layernorm"
    assert TABLE.backbones["nemotron"].eps == ("norm_eps",)
    # EXAONE 3.x config.json spells it layer_norm_epsilon
    assert resolve_final_norm({"model_type": "exaone", "layer_norm_epsilon": 3e-5}).eps == 3e-5


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------

def test_kimi_k3_resolves_through_text_config_to_kimi_linear():
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
              "text_config": {"model_type": "kimi_linear", "rms_norm_eps": 1e-5,
                              "hidden_size": 7168}}
    norm = resolve_final_norm(config)
    assert norm == FinalNorm(kind=final_norm_kind("kimi_linear"), model_type="kimi_linear",
                             eps=1e-5, path="kimi_k3 → text_config → kimi_linear")
    assert norm.kind == "rmsnorm"
    with pytest.raises(dataclasses.FrozenInstanceError):
        norm.kind = "rmsnorm_one_plus"  # type: ignore[misc]


def test_kimi_k3_bare_lookup_is_none():
    assert final_norm_kind("kimi_k3") is None


def test_kimi_k25_resolves_to_its_kimi_k2_backbone():
    config = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2",
                                                         "rms_norm_eps": 1e-6}}
    norm = resolve_final_norm(config)
    assert (norm.kind, norm.model_type, norm.path) == (
        "rmsnorm", "kimi_k2", "kimi_k25 → text_config → kimi_k2")


def test_eps_default_when_the_config_omits_it():
    norm = resolve_final_norm({"model_type": "kimi_k3",
                               "text_config": {"model_type": "kimi_linear"}})
    assert norm.eps == TABLE.backbones["kimi_linear"].eps_default == 1e-5
    assert resolve_final_norm({"model_type": "llama"}).eps == 1e-6


def test_eps_comes_from_the_backbone_not_the_wrapper():
    norm = resolve_final_norm({"model_type": "gemma3", "rms_norm_eps": 0.5,
                               "text_config": {"model_type": "gemma3_text",
                                               "rms_norm_eps": 1e-6}})
    assert norm.eps == 1e-6


def test_nemotron_h_eps_attribute():
    norm = resolve_final_norm({"model_type": "nemotron_h", "layer_norm_epsilon": 3e-5,
                               "rms_norm_eps": 0.25}, transformers_version="5.24.0")
    assert (norm.kind, norm.eps) == ("rmsnorm_fp32_mul", 3e-5)


def test_plain_backbone_path_is_just_its_type():
    norm = resolve_final_norm({"model_type": "qwen3_moe", "rms_norm_eps": 1e-6})
    assert norm == FinalNorm("rmsnorm", "qwen3_moe", 1e-6, "qwen3_moe")


def test_use_gemma_norm_overrides_a_coerced_mixtral_type():
    config = {"model_type": "minimax_m3_vl",
              "text_config": {"model_type": "mixtral", "use_gemma_norm": True,
                              "rms_norm_eps": 1e-6}}
    norm, reason = explain_final_norm(config)
    assert final_norm_kind("mixtral") == "rmsnorm"
    assert norm.kind == "rmsnorm_one_plus"
    assert norm.model_type == "mixtral"
    assert norm.path == "minimax_m3_vl → text_config → mixtral → use_gemma_norm=true"
    assert norm.eps == 1e-6
    assert "overrides" in reason


def test_use_gemma_norm_on_the_outer_config_also_counts():
    norm = resolve_final_norm({"model_type": "minimax_m3_vl", "use_gemma_norm": True,
                               "text_config": {"model_type": "mixtral"}})
    assert norm.kind == "rmsnorm_one_plus"
    assert norm.eps == TABLE.backbones["mixtral"].eps_default


def test_use_gemma_norm_false_overrides_nothing():
    norm = resolve_final_norm({"model_type": "minimax_m3_vl",
                               "text_config": {"model_type": "mixtral", "use_gemma_norm": False}})
    assert norm.kind == "rmsnorm"
    assert norm.path == "minimax_m3_vl → text_config → mixtral"


def test_use_gemma_norm_on_an_unknown_backbone_decides_the_kind():
    norm, reason = explain_final_norm({"model_type": "minimax_m3", "use_gemma_norm": True,
                                       "rms_norm_eps": 2e-6})
    assert (norm.kind, norm.model_type, norm.eps) == ("rmsnorm_one_plus", "minimax_m3", 2e-6)


def test_llm_config_path():
    norm = resolve_final_norm({"model_type": "internvl_chat",
                               "llm_config": {"model_type": "qwen2", "rms_norm_eps": 1e-6}})
    assert norm == FinalNorm("rmsnorm", "qwen2", 1e-6, "internvl_chat → llm_config → qwen2")


def test_language_config_path():
    norm = resolve_final_norm({"model_type": "deepseek_vl_v2",
                               "language_config": {"model_type": "deepseek_v2"}})
    assert norm == FinalNorm("rmsnorm", "deepseek_v2", 1e-6,
                             "deepseek_vl_v2 → language_config → deepseek_v2")


def test_nested_wrappers_are_followed():
    norm = resolve_final_norm({"model_type": "outer", "llm_config": {
        "model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear"}}})
    assert norm.path == "outer → llm_config → kimi_k3 → text_config → kimi_linear"


class _DuckConfig:
    """A config object that exposes its text backbone only through get_text_config()."""

    def __init__(self, model_type, text=None, **attrs):
        self.model_type = model_type
        self._text = text
        self.__dict__.update(attrs)

    def get_text_config(self, decoder=None):
        return self._text if self._text is not None else self


def test_get_text_config_path():
    config = _DuckConfig("some_vlm", _DuckConfig("glm4_moe", rms_norm_eps=1e-5))
    assert resolve_final_norm(config) == FinalNorm(
        "rmsnorm", "glm4_moe", 1e-5, "some_vlm → get_text_config() → glm4_moe")


def test_get_text_config_returning_self_stops():
    assert resolve_final_norm(_DuckConfig("phi3", rms_norm_eps=1e-5)).path == "phi3"


def test_config_json_path_input(tmp_path):
    path = _write(tmp_path / "config.json", {
        "model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear",
                                                 "rms_norm_eps": 1e-5}})
    expected = FinalNorm("rmsnorm", "kimi_linear", 1e-5, "kimi_k3 → text_config → kimi_linear")
    assert resolve_final_norm(str(path)) == expected
    assert resolve_final_norm(path) == expected
    assert resolve_final_norm(tmp_path) == expected  # a model directory


def test_unreadable_configs_raise_norm_error(tmp_path):
    with pytest.raises(NormError, match="no such config file"):
        resolve_final_norm(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(NormError, match=r"broken\.json:1:2: not valid JSON"):
        resolve_final_norm(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(NormError, match="JSON object"):
        read_config(tmp_path / "list.json")
    with pytest.raises(NormError, match="cannot resolve"):
        resolve_final_norm(42)


def test_transformers_config_objects():
    transformers = pytest.importorskip("transformers")
    gemma3 = transformers.Gemma3Config()
    norm = resolve_final_norm(gemma3)
    assert norm == FinalNorm("rmsnorm_one_plus", "gemma3_text", gemma3.text_config.rms_norm_eps,
                             "gemma3 → text_config → gemma3_text")
    assert resolve_final_norm(transformers.LlamaConfig(rms_norm_eps=3e-6)) == FinalNorm(
        "rmsnorm", "llama", 3e-6, "llama")
    assert resolve_final_norm(transformers.AutoConfig.for_model("gpt_oss")).kind == \
        "rmsnorm_fp32_weight"


def test_transformers_kimi_k25_config_object():
    transformers = pytest.importorskip("transformers")
    if "kimi_k25" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no kimi_k25")
    config = transformers.CONFIG_MAPPING["kimi_k25"](
        text_config={"model_type": "kimi_k2", "rms_norm_eps": 1e-6})
    # transformers rewrites the kimi_k2 text config to deepseek_v3: same norm either way
    norm = resolve_final_norm(config)
    # (transformers 5.14 keeps kimi_k2; later versions rewrite it to deepseek_v3: the same norm)
    backbone = "deepseek_v3" if norm.model_type == "deepseek_v3" else "kimi_k2"
    assert norm == FinalNorm("rmsnorm", backbone, 1e-6, f"kimi_k25 → text_config → {backbone}")


def test_unknown_backbone_is_none_with_reason():
    config = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_foo"}}
    assert resolve_final_norm(config) is None
    norm, reason = explain_final_norm(config)
    assert norm is None
    assert reason.startswith("kimi_k3 → text_config → kimi_foo: ")
    assert "'kimi_foo' is not a text backbone" in reason
    assert "refusing to guess" in reason


def test_outer_type_without_its_text_config_is_none_with_reason():
    norm, reason = explain_final_norm({"model_type": "kimi_k3", "hidden_size": 7168})
    assert norm is None
    assert reason == ("kimi_k3: kimi_k3 is an outer multimodal model_type whose final norm "
                      "belongs to its text backbone under text_config, but this config has no "
                      "text_config")


def test_missing_model_type_is_none_with_reason():
    norm, reason = explain_final_norm({"text_config": {"rms_norm_eps": 1e-5}})
    assert norm is None
    assert reason == ("<no model_type> → text_config → <no model_type>: the text backbone "
                      "config has no model_type")


def test_a_custom_table_can_be_passed(tmp_path):
    path = tmp_path / "norms.yaml"
    path.write_text(textwrap.dedent("""\
        version: 1
        kinds:
          plain:
            formula: y = w·x̂
            center: false
            offset: 0
            bias: false
            multiply: after_cast
            weight_dtype: model
        backbones:
          toy:
            kind: plain
            eps: [toy_eps]
            source: a test
        """), encoding="utf-8")
    table = load_norms(path)
    assert resolve_final_norm({"model_type": "toy", "toy_eps": 0.5}, table=table) == FinalNorm(
        "plain", "toy", 0.5, "toy")
    assert final_norm_kind("llama", table=table) is None


# ---------------------------------------------------------------------------------------------
# Facts per transformers version
# ---------------------------------------------------------------------------------------------

def test_nemotron_h_norm_changed_in_transformers_5_18():
    entry = TABLE.backbones["nemotron_h"]
    assert [v.transformers for v in entry.by_version] == ["<5.18"]
    assert entry.at("5.14.1").kind == entry.at("5.17.0").kind == "rmsnorm"
    assert entry.at("5.18.0").kind == entry.at("5.24.0").kind == "rmsnorm_fp32_mul"
    assert entry.at("5.14.1").eps == entry.eps and "5.18.0" in entry.at("5.14.1").source
    cfg = {"model_type": "nemotron_h", "layer_norm_epsilon": 1e-5}
    assert resolve_final_norm(cfg, transformers_version="5.14.1").kind == "rmsnorm"
    assert resolve_final_norm(cfg, transformers_version="5.24.0").kind == "rmsnorm_fp32_mul"
    assert final_norm_kind("nemotron_h", transformers_version="5.16.0") == "rmsnorm"
    norm, why = explain_final_norm(cfg, transformers_version="5.14.1")
    assert "transformers 5.14.1: the fact for <5.18" in why


def test_resolution_follows_the_installed_transformers_version(monkeypatch):
    import chatgrammar.core.norms as norms

    cfg = {"model_type": "nemotron_h"}
    monkeypatch.setattr(norms, "installed_transformers_version", lambda: "5.14.1")
    assert resolve_final_norm(cfg).kind == "rmsnorm"
    monkeypatch.setattr(norms, "installed_transformers_version", lambda: "5.24.0")
    assert resolve_final_norm(cfg).kind == "rmsnorm_fp32_mul"
    monkeypatch.setattr(norms, "installed_transformers_version", lambda: None)
    assert resolve_final_norm(cfg).kind == "rmsnorm_fp32_mul"  # the entry's own facts


@pytest.mark.parametrize("version, text, inside", [
    ("5.14.1", "<5.18", True), ("5.18.0", "<5.18", False), ("5.18", ">=5.18", True),
    ("5.25.0.dev0", ">=5.15,<5.25", False), ("5.24.9", ">=5.15, <5.25", True),
    ("4.57.6", "==4.57.6", True), ("5.0", "!=5.0.0", False),
])
def test_version_ranges(version, text, inside):
    from chatgrammar.core.norms import version_in_range

    assert version_in_range(version, text) is inside


def test_by_version_is_validated(tmp_path):
    path = tmp_path / "norms.yaml"
    path.write_text("version: 1\nkinds:\n" + textwrap.indent(textwrap.dedent(_GOOD_KIND), "  ")
                    + "backbones:\n"
                    "  toy:\n"                                   # 11
                    "    kind: rms\n"
                    "    eps: [rms_norm_eps]\n"
                    "    source: a test\n"
                    "    by_version:\n"
                    "      - transformers: soon\n"               # 16
                    "        kind: rms\n"
                    "        source: x\n"
                    "      - transformers: '<5.18'\n"            # 19
                    "        kind: rms_gemma\n"
                    "        colour: blue\n", encoding="utf-8")  # 21 (and source missing)
    found = {(p.line, p.col, p.path): p.message for p in validate_norms(path,
                                                                         use_transformers=False)}
    assert set(found) == {(16, 23, "backbones.toy.by_version[0].transformers"),
                          (19, 9, "backbones.toy.by_version[1]"),
                          (20, 15, "backbones.toy.by_version[1].kind"),
                          (21, 9, "backbones.toy.by_version[1].colour")}, found
    assert "version range" in found[(16, 23, "backbones.toy.by_version[0].transformers")]
    assert "missing required key 'source'" in found[(19, 9, "backbones.toy.by_version[1]")]
    assert "unknown kind 'rms_gemma'" in found[(20, 15, "backbones.toy.by_version[1].kind")]


def test_validation_errors_of_the_new_keys_are_located(tmp_path):
    path = tmp_path / "norms.yaml"
    path.write_text(textwrap.dedent("""\
        version: 1
        kinds:
          odd:
            formula: y
            center: false
            offset: 0
            bias: false
            multiply: float32
            weight_dtype: model
            statistics: sometimes
        backbones:
          toy:
            kind: odd
            eps: rms_norm_eps
            source: a test
            inv_sqrt: cbrt
        """), encoding="utf-8")
    found = {(p.line, p.path): p.message for p in validate_norms(path, use_transformers=False)}
    assert found == {
        (10, "kinds.odd.statistics"): "statistics must be one of manual, fused; got 'sometimes'",
        (16, "backbones.toy.inv_sqrt"): "inv_sqrt must be one of rsqrt, pow; got 'cbrt'"}


def test_validation_of_odd_values_is_located_and_never_crashes(tmp_path):
    path = tmp_path / "norms.yaml"
    path.write_text(textwrap.dedent("""\
        version: 1
        kinds:
          a: 3
          1:
            formula: x
        backbones:
          x:
            kind: a
            eps: []
            eps_default: -1
            source: "  "
            transformers: {module: norm}
          y: [1]
        overrides:
          f: {when: [1], kind: nope, source: s}
        outer_types:
          o: {text_key: foo, source: s}
        """), encoding="utf-8")
    problems = validate_norms(path, use_transformers=False)
    assert all(p.line and p.col and p.path for p in problems)
    found = {p.path: p.message for p in problems}
    assert found["kinds.a"] == "kind 'a' must be a mapping"
    assert "keys of kinds must be strings" in [p.message for p in problems]
    assert found["backbones.x.eps"] == "eps must be a string or a non-empty list of strings"
    assert found["backbones.x.eps_default"] == "eps_default must be a positive number; got -1"
    assert found["backbones.x.source"] == "source must not be empty"
    assert found["backbones.x.transformers"] == \
        "transformers is missing required key 'class'"
    assert found["backbones.y"] == "backbone 'y' must be a mapping"
    assert found["overrides.f.when"].startswith("when must be a scalar")
    assert found["overrides.f.kind"] == "unknown kind 'nope'; known kinds: a"
    assert found["outer_types.o.text_key"].startswith("text_key must be one of text_config")


# ---------------------------------------------------------------------------------------------
# build_final_norm
# ---------------------------------------------------------------------------------------------

def test_build_final_norm_shapes_dtypes_and_errors():
    torch = pytest.importorskip("torch")
    import chatgrammar as cg

    k3 = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear",
                                                    "hidden_size": 16, "rms_norm_eps": 1e-5}}
    norm = cg.build_final_norm(k3, dtype=torch.bfloat16)
    assert isinstance(norm, torch.nn.Module) and norm.kind.name == "rmsnorm"
    assert norm.weight.shape == (16,) and norm.weight.dtype == torch.bfloat16
    assert norm.eps == 1e-5 and norm.bias is None
    # the dtype comes from the config when not given; gpt-oss keeps its weight in fp32
    assert cg.build_final_norm({**k3["text_config"], "dtype": "bfloat16"}).weight.dtype == \
        torch.bfloat16
    assert cg.build_final_norm({"model_type": "llama", "hidden_size": 8}).weight.dtype == \
        torch.float32
    gpt = cg.build_final_norm({"model_type": "gpt_oss", "hidden_size": 8}, dtype="bfloat16")
    assert gpt.weight.dtype == torch.float32
    # Gemma-style weights start at 0 (1 + w), LayerNorms have a bias
    assert not cg.build_final_norm({"model_type": "gemma3_text", "hidden_size": 4}).weight.any()
    assert cg.build_final_norm({"model_type": "phi", "hidden_size": 4}).bias.shape == (4,)
    # a checkpoint's tensor loads into it
    w = torch.randn(16, dtype=torch.bfloat16)
    norm.load_state_dict({"weight": w})
    assert torch.equal(norm.weight.detach(), w)
    assert norm(torch.randn(2, 3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(NormError, match="no final norm for this config: kimi_k3: "):
        cg.build_final_norm({"model_type": "kimi_k3"})
    with pytest.raises(NormError, match="no hidden_size"):
        cg.build_final_norm({"model_type": "llama"})
    assert cg.build_final_norm({"model_type": "llama"}, hidden_size=4).weight.shape == (4,)


def test_build_final_norm_follows_the_transformers_version():
    torch = pytest.importorskip("torch")
    cfg = {"model_type": "nemotron_h", "hidden_size": 64, "layer_norm_epsilon": 1e-5}
    old = build_final_norm(cfg, dtype="bfloat16", transformers_version="5.14.1")
    new = build_final_norm(cfg, dtype="bfloat16", transformers_version="5.24.0")
    assert (old.kind.name, new.kind.name) == ("rmsnorm", "rmsnorm_fp32_mul")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, generator=gen) * 0.5 + 1).to(torch.bfloat16)
    x = (torch.randn(8, 64, generator=gen) * 0.3).to(torch.bfloat16)
    for m in (old, new):
        m.load_state_dict({"weight": w})
    with torch.no_grad():
        differ = (old(x) != new(x)).float().mean().item()
    assert differ > 0.05  # one bf16 rounding on a good share of the outputs


def test_nemotron_h_version_fact_is_needed_against_the_installed_transformers():
    """On whichever transformers runs the tests, only the fact of its own range is exact."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    version = transformers.__version__
    config = _tiny_config(transformers.CONFIG_MAPPING["nemotron_h"], "layer_norm_epsilon")
    torch.manual_seed(0)
    ref = transformers.AutoModel.from_config(config).norm_f.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64, generator=gen) * 0.5 + 1)
    x = (torch.randn(4, 16, 64, generator=gen) * 0.3).to(torch.bfloat16)
    other = "5.24.0" if TABLE.backbones["nemotron_h"].at(version).kind == "rmsnorm" else "5.14.1"
    results = {}
    for v in (version, other):
        ours = build_final_norm(config, dtype=torch.bfloat16, transformers_version=v)
        ours.load_state_dict(ref.state_dict())
        with torch.no_grad():
            results[v] = torch.equal(ours(x), ref(x))
    assert results == {version: True, other: False}


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

_GOOD_KIND = """\
    rms:
      formula: y = w · cast(x̂)
      center: false
      offset: 0
      bias: false
      multiply: after_cast
      weight_dtype: model
"""


def _bad_norms(tmp_path: Path) -> Path:
    text = (
        "version: 1\n"                               # 1
        "kinds:\n"                                   # 2
        + textwrap.indent(textwrap.dedent(_GOOD_KIND), "  ")  # 3-9
        + "outer_types:\n"                           # 10
        "  kimi_k3:\n"                               # 11
        "    text_key: text_config\n"                # 12
        "    text_type: kimi_linear\n"               # 13
        "    source: remote code\n"                  # 14
        "backbones:\n"                               # 15
        "  kimi_k3:\n"                               # 16  outer type used as a key
        "    kind: rms\n"                            # 17
        "    eps: [rms_norm_eps]\n"                  # 18
        "    source: wrong on purpose\n"             # 19
        "  llama:\n"                                 # 20
        "    kind: rms_gemma\n"                      # 21  unknown kind
        "    eps: [rms_norm_eps]\n"                  # 22
        "    source: transformers LlamaRMSNorm\n"    # 23
        "  qwen2:\n"                                 # 24
        "    kind: rms\n"                            # 25
        "    epsilon: [rms_norm_eps]\n"              # 26  unknown key (and eps missing)
        "    source: transformers Qwen2RMSNorm\n"    # 27
    )
    path = tmp_path / "norms.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_validation_reports_outer_keys_unknown_kinds_and_unknown_keys(tmp_path):
    path = _bad_norms(tmp_path)
    problems = validate_norms(path, use_transformers=False)
    found = [(p.line, p.col, p.path) for p in problems]
    assert found == [
        (16, 3, "backbones.kimi_k3"),
        (21, 11, "backbones.llama.kind"),
        (24, 3, "backbones.qwen2"),          # missing eps, reported at the entry
        (26, 5, "backbones.qwen2.epsilon"),
    ], [p.render() for p in problems]
    by_path = {p.path: p for p in problems}
    assert "outer multimodal model_type" in by_path["backbones.kimi_k3"].message
    assert "unknown kind 'rms_gemma'" in by_path["backbones.llama.kind"].message
    assert "unknown key 'epsilon'" in by_path["backbones.qwen2.epsilon"].message
    assert "did you mean 'eps'" in by_path["backbones.qwen2.epsilon"].message
    assert "missing required key 'eps'" in by_path["backbones.qwen2"].message
    assert all(p.file == str(path) for p in problems)
    assert str(by_path["backbones.llama.kind"]).startswith(f"{path}:21:11: backbones.llama.kind: ")


def test_load_norms_raises_norm_error_listing_every_problem(tmp_path):
    path = _bad_norms(tmp_path)
    with pytest.raises(NormError) as info:
        load_norms(path)
    message = str(info.value)
    assert "4 problems" in message
    assert f"{path}:21:11" in message and f"{path}:26:5" in message


def test_validation_knows_transformers_wrapper_types(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "norms.yaml"
    path.write_text("version: 1\nkinds:\n" + textwrap.indent(textwrap.dedent(_GOOD_KIND), "  ")
                    + "backbones:\n"
                    "  gemma3:\n"                          # line 11: a transformers VLM type
                    "    kind: rms\n"
                    "    eps: rms_norm_eps\n"
                    "    source: wrong on purpose\n"
                    "  gemma3_text:\n"
                    "    kind: rms\n"
                    "    eps: rms_norm_eps\n"
                    "    source: fine\n", encoding="utf-8")
    problems = validate_norms(path)
    assert [(p.line, p.col, p.path) for p in problems] == [(11, 3, "backbones.gemma3")]
    assert "transformers declares its text backbone under text_config" in problems[0].message
    assert "'gemma3_text'" in problems[0].message
    assert validate_norms(path, use_transformers=False) == []


def test_validation_of_kind_parameters_and_top_level(tmp_path):
    path = tmp_path / "norms.yaml"
    path.write_text(textwrap.dedent("""\
        version: 2
        kinds:
          odd:
            formula: y
            center: maybe
            offset: 2
            bias: false
            multiply: sometimes
            weight_dtype: model
        backbones: {}
        extra: 1
        """), encoding="utf-8")
    found = {(p.line, p.path): p.message for p in validate_norms(path, use_transformers=False)}
    assert set(found) == {(1, "version"), (5, "kinds.odd.center"), (6, "kinds.odd.offset"),
                          (8, "kinds.odd.multiply"), (11, "extra")}
    assert "unsupported version 2" in found[(1, "version")]
    assert "must be a bool" in found[(5, "kinds.odd.center")]


def test_validation_reports_yaml_errors_duplicates_and_unsafe_tags(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("version: 1\nkinds: [\n", encoding="utf-8")
    (problem,) = validate_norms(broken, use_transformers=False)
    assert problem.message.startswith("invalid YAML") and problem.line == 3

    dup = tmp_path / "dup.yaml"
    dup.write_text("version: 1\nkinds: {}\nbackbones: {}\nkinds: {}\n", encoding="utf-8")
    (problem,) = validate_norms(dup, use_transformers=False)
    assert (problem.line, problem.path) == (4, "kinds")
    assert "duplicate key 'kinds' (first defined on line 2)" in problem.message

    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("version: !!python/object/apply:os.system ['echo pwned']\n"
                      "kinds: {}\nbackbones: {}\n", encoding="utf-8")
    (problem,) = validate_norms(unsafe, use_transformers=False)
    assert problem.line == 1 and "invalid YAML" in problem.message

    assert validate_norms(tmp_path / "nope.yaml")[0].message == "no such norms file"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _k3_config(tmp_path: Path) -> Path:
    return _write(tmp_path / "config.json", {
        "model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear",
                                                 "rms_norm_eps": 1e-5}})


def _run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    return subprocess.run([sys.executable, "-m", "chatgrammar", *args], capture_output=True,
                          text=True, encoding="utf-8", env=env, cwd=ROOT, timeout=120)


def test_cli_subprocess_resolves_k3(tmp_path):
    result = _run_module("norm", str(_k3_config(tmp_path)))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "path:    kimi_k3 → text_config → kimi_linear"
    assert lines[1].startswith("kind:    rmsnorm ")
    assert lines[2] == "eps:     1e-05"


def test_cli_subprocess_unknown_and_missing(tmp_path):
    unknown = _write(tmp_path / "u.json", {"model_type": "kimi_k3",
                                           "text_config": {"model_type": "kimi_foo"}})
    result = _run_module("norm", str(unknown))
    assert result.returncode == 1
    assert "kind:    unknown" in result.stdout
    assert "'kimi_foo' is not a text backbone in norms.yaml" in result.stderr

    result = _run_module("norm", str(tmp_path / "missing.json"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "no such config file" in result.stderr and "Traceback" not in result.stderr


def test_cli_main_in_process(tmp_path, capsys):
    from chatgrammar.cli import main

    assert main(["norm", str(_k3_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "kimi_k3 → text_config → kimi_linear" in out and "eps:     1e-05" in out

    assert main(["norm", str(_k3_config(tmp_path)), "--output", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["kind"] == "rmsnorm" and payload["eps"] == 1e-5
    assert payload["path"] == "kimi_k3 → text_config → kimi_linear"

    gemma = _write(tmp_path / "g.json", {"model_type": "minimax_m3_vl", "text_config": {
        "model_type": "mixtral", "use_gemma_norm": True}})
    assert main(["norm", str(gemma)]) == 0
    assert "kind:    rmsnorm_one_plus" in capsys.readouterr().out

    unknown = _write(tmp_path / "u.json", {"model_type": "kimi_k3"})
    assert main(["norm", str(unknown), "--output", "json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["resolved"] is False and payload["kind"] is None
    assert "has no text_config" in payload["reason"]

    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    assert main(["norm", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chatgrammar norm: error: ") and err.count("\n") == 1
    assert main(["norm"]) == 2  # usage error
    capsys.readouterr()


def test_cli_transformers_version(tmp_path, capsys):
    from chatgrammar.cli import main

    cfg = _write(tmp_path / "config.json", {"model_type": "nemotron_h"})
    assert main(["norm", str(cfg), "--transformers-version", "5.14.1"]) == 0
    out = capsys.readouterr().out
    assert "kind:    rmsnorm " in out and "transformers 5.14.1: the fact for <5.18" in out
    assert main(["norm", str(cfg), "--transformers-version", "5.24.0"]) == 0
    assert "kind:    rmsnorm_fp32_mul " in capsys.readouterr().out


def test_cli_custom_norms_table(tmp_path, capsys):
    from chatgrammar.cli import main

    bad = _bad_norms(tmp_path)
    assert main(["norm", str(_k3_config(tmp_path)), "--norms", str(bad)]) == 2
    assert "invalid norms table" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The numpy reference (no torch needed)
# ---------------------------------------------------------------------------------------------

def test_apply_norm_hand_computed_values():
    x = np.array([[3.0, 4.0]])  # mean(x²) = 12.5
    w = np.array([1.0, 2.0])
    r = 1 / np.sqrt(12.5)
    np.testing.assert_allclose(apply_norm("rmsnorm", x, w, eps=0.0), [[3 * r, 8 * r]],
                               rtol=1e-6)
    np.testing.assert_allclose(apply_norm("rmsnorm_one_plus", x, w, eps=0.0),
                               [[3 * r * 2, 4 * r * 3]], rtol=1e-6)
    # mean 3.5, var 0.25: x̂ = [-1, 1]
    np.testing.assert_allclose(apply_norm("layernorm", x, w, eps=0.0, bias=[0.5, -0.5]),
                               [[-0.5, 1.5]], rtol=1e-6)
    np.testing.assert_allclose(apply_norm("layernorm_no_bias", x, w, eps=0.0), [[-1.0, 2.0]],
                               rtol=1e-6)
    # eps enters under the root
    np.testing.assert_allclose(apply_norm("rmsnorm", x, None, eps=12.5),
                               [[3 / 5, 4 / 5]], rtol=1e-6)


def test_offset_dtype_weight_rounds_one_plus_w_to_the_model_dtype():
    # Nemotron's LayerNorm1P: `weight + 1.0` in bf16, then F.layer_norm's fp32 scaling
    from chatgrammar.core.norms import _rounder

    bf16 = _rounder("bfloat16")
    rng = np.random.default_rng(4)
    x, w, b = rng.normal(size=(32, 64)), rng.normal(size=64) * 0.5, rng.normal(size=64) * 0.5
    kind = TABLE.kinds["layernorm_one_plus"]
    assert (kind.center, kind.offset, kind.bias, kind.offset_dtype) == (True, 1, True, "weight")
    ours = apply_norm(kind, x, w, 1e-5, bias=b, dtype="bfloat16")
    np.testing.assert_array_equal(
        ours, apply_norm("layernorm", x, bf16(bf16(w) + 1), 1e-5, bias=b, dtype="bfloat16"))
    in_fp32 = dataclasses.replace(kind, offset_dtype="float32")  # 1 + w.float(), Gemma-style
    assert not _bf16_match(apply_norm(in_fp32, x, w, 1e-5, bias=b, dtype="bfloat16"), ours)
    np.testing.assert_allclose(apply_norm(kind, x, w, 1e-5, bias=b),
                               apply_norm(in_fp32, x, w, 1e-5, bias=b), rtol=1e-6)
    # the default is fp32 (every Gemma-style kind)
    assert TABLE.kinds["rmsnorm_one_plus"].offset_dtype == "float32"


def test_validation_of_offset_dtype(tmp_path):
    path = tmp_path / "norms.yaml"
    path.write_text(textwrap.dedent("""\
        version: 1
        kinds:
          odd:
            formula: y
            center: true
            offset: 1
            bias: true
            multiply: float32
            weight_dtype: model
            offset_dtype: model
        backbones: {}
        """), encoding="utf-8")
    (problem,) = validate_norms(path, use_transformers=False)
    assert (problem.line, problem.path) == (10, "kinds.odd.offset_dtype")
    assert "offset_dtype must be one of float32, weight; got 'model'" in problem.message


def test_apply_norm_bfloat16_values_are_bf16_exact():
    rng = np.random.default_rng(0)
    y = apply_norm("rmsnorm_fp32_mul", rng.normal(size=(4, 64)), rng.normal(size=64),
                   dtype="bfloat16")
    assert y.dtype == np.float32
    assert np.all(y.view(np.uint32) & 0xFFFF == 0)


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    from chatgrammar.core.norms import _rounder

    rng = np.random.default_rng(1)
    x = (rng.normal(size=4096) * 10.0 ** rng.integers(-8, 8, size=4096)).astype(np.float32)
    expected = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(_rounder("bfloat16")(x), expected)


def _bf16_match(ref: np.ndarray, out: np.ndarray) -> bool:
    """Equal up to a rare 1-ulp flip (torch and numpy reduce in different orders)."""
    return bool(np.isclose(ref, out, rtol=2.0 ** -7, atol=1e-6).all()
                and (ref != out).mean() <= 0.01)


def _f32_match(ref: np.ndarray, out: np.ndarray) -> bool:
    return bool(np.allclose(ref, out, rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("a, b, dtype", [
    ("rmsnorm", "rmsnorm_fp32_mul", "bfloat16"),             # cast-then-multiply vs cast once
    ("rmsnorm_fp32_mul", "rmsnorm_fp32_weight", "bfloat16"),  # weight rounded to bf16 or not
    ("rmsnorm_fp32_mul", "rmsnorm_one_plus", "float32"),
    ("rmsnorm", "layernorm_no_bias", "float32"),
])
def test_kinds_are_distinguishable_by_the_truth_criterion(a, b, dtype):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 64)).astype(np.float32) + 0.3
    w = (rng.normal(size=64) * 0.5 + 1).astype(np.float32)  # not bf16-exact
    match = _bf16_match if dtype == "bfloat16" else _f32_match
    ya = apply_norm(a, x, w, 1e-6, dtype=dtype)
    yb = apply_norm(b, x, w, 1e-6, dtype=dtype)
    assert match(ya, ya)
    assert not match(ya, yb)


def test_apply_norm_takes_a_kind_object():
    # MiniMax-M3's remote-code norm: 1 + w, but multiplied after the cast (see norms.yaml)
    remote = NormKind("remote_one_plus", "y = (1 + w) · cast(x̂)", center=False, offset=1,
                      bias=False, multiply="after_cast", weight_dtype="model")
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(32, 64)), rng.normal(size=64) * 0.5
    ours = apply_norm(remote, x, w, 1e-6, dtype="float32")
    np.testing.assert_allclose(ours, apply_norm("rmsnorm_one_plus", x, w, 1e-6), rtol=1e-6)
    bf16 = apply_norm(remote, x, w, 1e-6, dtype="bfloat16")
    assert not _bf16_match(bf16, apply_norm("rmsnorm_one_plus", x, w, 1e-6, dtype="bfloat16"))


def test_apply_norm_rejects_unknown_kind_and_dtype():
    with pytest.raises(NormError, match="unknown norm kind 'rms_norm'"):
        apply_norm("rms_norm", np.ones((1, 4)))
    with pytest.raises(NormError, match="unsupported dtype"):
        apply_norm("rmsnorm", np.ones((1, 4)), dtype="int8")


# ---------------------------------------------------------------------------------------------
# Numeric truth: every entry transformers implements, against transformers' own module
# ---------------------------------------------------------------------------------------------

_TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             vocab_size=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16,
             v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size_per_layer_input=64,
             hidden_size_per_layer_input=8)
# types whose config class needs more than _TINY to build a model (a per-type addition)
_TINY_BY_TYPE = {"lfm2_moe": dict(layer_types=["full_attention"])}  # layer_types has no default
_EPS = 0.05  # large on purpose: reading the wrong eps attribute shows in the outputs

_IMPLEMENTED = sorted(name for name, b in TABLE.backbones.items() if b.transformers)


def _tiny_config(config_cls, eps_attr: str):
    if dataclasses.is_dataclass(config_cls):
        accepted = {f.name for f in dataclasses.fields(config_cls)}
    else:  # older transformers: plain __init__ keyword arguments
        accepted = set(inspect.signature(config_cls.__init__).parameters)
    tiny = {**_TINY, **_TINY_BY_TYPE.get(getattr(config_cls, "model_type", ""), {})}
    kwargs = {k: v for k, v in tiny.items() if k in accepted}
    kwargs[eps_attr] = _EPS
    return config_cls(**kwargs)


def test_every_implemented_entry_is_checked():
    # the parametrisation below must not silently shrink
    assert len(_IMPLEMENTED) >= 70
    assert {"gemma4_text", "gpt_oss", "nemotron_h", "minimax_m3_vl_text", "kimi_k2",
            "kimi_linear", "phi", "cohere", "nemotron", "phimoe", "helium", "lfm2", "lfm2_moe",
            "falcon_h1", "granitemoehybrid", "cohere2", "exaone"} <= set(_IMPLEMENTED)


@pytest.mark.parametrize("name", _IMPLEMENTED)
def test_kind_matches_transformers_final_norm(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    entry = TABLE.backbones[name].at(transformers.__version__)  # this version's facts
    ref = entry.transformers
    model_type = ref.get("model_type", name)
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} does not implement {model_type}")
    config_cls = transformers.CONFIG_MAPPING[model_type]
    eps_attr = entry.eps[0]

    # eps_default is the config class default
    assert getattr(config_cls(), eps_attr) == pytest.approx(entry.eps_default)

    config = _tiny_config(config_cls, eps_attr)
    resolved = resolve_final_norm(config)
    if model_type == name:  # a config object resolves to the entry itself
        assert resolved == FinalNorm(entry.kind, name, _EPS, name)

    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config)
    module = getattr(model, ref["module"])
    assert type(module).__name__ == ref["class"]
    kind = TABLE.kinds[entry.kind]

    # fp32 weight ⇔ transformers keeps this module in fp32 when loading in bf16
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    assert (ref["module"] in keep) == (kind.weight_dtype == "float32")
    has_bias = getattr(module, "bias", None) is not None
    assert has_bias == kind.bias

    hidden = config.hidden_size
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        # Gemma-style weights are centred on 0, plain ones on 1; random either way
        module.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (1 - kind.offset))
        if has_bias:
            module.bias.copy_(torch.randn(hidden, generator=gen) * 0.5)
    x32 = torch.randn(4, 16, hidden, generator=gen) * 0.3 + 0.05

    for dtype_name, dtype, match in (("float32", torch.float32, _f32_match),
                                     ("bfloat16", torch.bfloat16, _bf16_match)):
        weight_dtype = torch.float32 if kind.weight_dtype == "float32" else dtype
        norm = module.to(weight_dtype)
        x = x32.to(dtype)
        with torch.no_grad():
            out = norm(x)
        assert out.dtype == dtype
        w = norm.weight.detach().float().numpy()
        b = norm.bias.detach().float().numpy() if has_bias else None
        xs = x.float().numpy()
        got = out.float().numpy()
        expected = apply_norm(entry.kind, xs, w, _EPS, bias=b, dtype=dtype_name)
        assert match(expected, got), (
            f"{name} ({dtype_name}): kind {entry.kind} disagrees with transformers "
            f"{ref['class']}; max abs diff {np.abs(expected - got).max():.3g}, "
            f"{(expected != got).mean():.1%} of values differ")
        # the torch module chatgrammar builds is bit-exact with transformers' own
        ours = build_final_norm(config, dtype=dtype)
        assert ours.weight.dtype == norm.weight.dtype
        ours.load_state_dict(norm.state_dict())
        with torch.no_grad():
            mine = ours(x)
        assert mine.dtype == out.dtype and torch.equal(mine, out), (
            f"{name} ({dtype_name}): build_final_norm differs from transformers "
            f"{ref['class']} on {(mine != out).float().mean().item():.1%} of values")
        # and no kind with a different formula would also have matched (in fp32 the cast
        # order is invisible, so there only the formula itself must differ)
        for other in TABLE.kinds.values():
            formula = (other.center, other.offset, other.bias)
            if formula == (kind.center, kind.offset, kind.bias) and (
                    dtype_name == "float32" or other.multiply == kind.multiply):
                continue  # same numbers here (weight_dtype is checked via _keep_in_fp32)
            if other.bias and not has_bias:
                continue  # a bias kind without a bias is the no-bias kind
            alt = apply_norm(other, xs, w, _EPS, bias=b, dtype=dtype_name)
            assert not match(alt, got), f"{name} ({dtype_name}) also matches {other.name}"
        module = norm.float()
