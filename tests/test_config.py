"""presets.yaml and the sampling settings: validated, with errors that name the place."""

import pytest

from miniserve.core.config import FIELDS, ConfigError, SamplingParams, load_presets


def test_shipped_presets_have_the_documented_values():
    presets = load_presets()
    assert set(presets) >= {"factual", "conservative", "balanced", "creative"}
    assert presets["factual"].temperature == 0 and presets["factual"].greedy
    c = presets["conservative"]
    assert (c.temperature, c.top_k, c.top_p) == (0.3, 20, 0.90)
    b = presets["balanced"]
    assert (b.temperature, b.top_k, b.top_p) == (0.7, 50, 0.95)
    r = presets["creative"]
    assert (r.temperature, r.top_k, r.top_p) == (1.0, 80, 0.98)


@pytest.mark.parametrize(
    "body, words",
    [
        ("presets:\n  fast:\n    temprature: 0.5\n", ["fast", "temprature", "unknown"]),
        ("presets:\n  fast:\n    top_k: many\n", ["fast", "top_k", "number"]),
        ("presets:\n  fast:\n    top_p: 1.5\n", ["fast", "top_p", "(0, 1]"]),
        ("presets:\n  fast:\n    max_new_tokens: 2.5\n", ["fast", "max_new_tokens", "whole"]),
        ("presets:\n  fast:\n    temperature: true\n", ["fast", "temperature"]),
        ("", ["empty"]),
        ("presets: [1, 2\n", ["YAML"]),
        ("other: 1\n", ["presets"]),
        ("presets:\n  fast: 3\n", ["fast", "mapping"]),
    ],
)
def test_bad_presets_file_names_file_preset_and_field(tmp_path, body, words):
    path = tmp_path / "presets.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_presets(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_missing_presets_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_presets(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", 100),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("min_p", 2),
        ("max_new_tokens", 0),
        ("max_new_tokens", 10**9),
        ("repetition_penalty", 0),
        ("temperature", float("nan")),
        ("top_k", "5"),
    ],
)
def test_params_out_of_range_name_the_field(field, value):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and field in str(info.value)


def test_defaults_are_valid_and_edges_allowed():
    for name, spec in FIELDS.items():
        SamplingParams(**{name: spec.default})
        if spec.kind is not tuple:  # a list of strings: its high is a count
            SamplingParams(**{name: spec.high})
    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=0)
    with pytest.raises(ConfigError):
        SamplingParams(seed=-1)


def test_greedy_is_built_in_and_a_presets_file_overrides_it(tmp_path):
    from miniserve.core.config import BUILTIN_PRESETS, GREEDY

    presets = load_presets()
    assert presets[GREEDY] == BUILTIN_PRESETS[GREEDY] and presets[GREEDY].greedy
    g = presets[GREEDY]
    assert (g.top_k, g.top_p, g.min_p, g.repetition_penalty) == (0, 1.0, 0.0, 1.0)
    path = tmp_path / "presets.yaml"
    path.write_text("presets:\n  fast:\n    temperature: 0.5\n")
    assert list(load_presets(path)) == ["fast", GREEDY]  # added to a file that lacks it
    path.write_text("presets:\n  greedy:\n    temperature: 0.9\n  fast:\n    top_k: 3\n")
    own = load_presets(path)
    assert list(own) == [GREEDY, "fast"] and own[GREEDY].temperature == 0.9
