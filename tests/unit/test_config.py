"""Config machinery: YAML dialect, dataclass building, overrides and every error message."""

# The string annotations this import produces are what config.from_dict must resolve.
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from hpcrl.config import ConfigError, apply_overrides, dump_yaml, from_dict, load_config, load_yaml, to_dict


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimConfig:
    lr: float
    """Peak learning rate."""
    betas: tuple[float, ...] = (0.9, 0.95)
    schedule: Literal["constant", "cosine"] = "constant"

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    num_steps: int
    optim: OptimConfig
    use_kl: bool = False
    name: str = "run"
    run_dir: Path = Path("runs")
    tags: list[str] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)
    max_tokens: int | None = None
    pair: tuple[int, str] = (1, "a")


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraConfig:
    rank: int = 8


@dataclass(kw_only=True, slots=True, frozen=True)
class RunConfig:
    train: TrainConfig
    lora: LoraConfig | None = None
    sections: dict[str, LoraConfig] = field(default_factory=dict)
    seed: int | str = 0


def minimal() -> dict:
    return {"train": {"num_steps": 10, "optim": {"lr": 1e-4}}}


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- from_dict: normal cases -----------------------------------------------------------------------


def test_from_dict_builds_nested_dataclasses_with_defaults() -> None:
    cfg = from_dict(RunConfig, minimal())
    assert cfg == RunConfig(train=TrainConfig(num_steps=10, optim=OptimConfig(lr=1e-4)))
    assert cfg.lora is None


def test_from_dict_converts_every_supported_type() -> None:
    data = {
        "train": {
            "num_steps": 3e5,
            "optim": {"lr": 1, "betas": [0.8, 1], "schedule": "cosine"},
            "use_kl": True,
            "name": "x",
            "run_dir": "/tmp/r",
            "tags": ["a", "b"],
            "extra": {"k": 2},
            "max_tokens": 7,
            "pair": [2, "b"],
        },
        "lora": {"rank": 4},
        "sections": {"s1": {"rank": 2}},
        "seed": "auto",
    }
    cfg = from_dict(RunConfig, data)
    assert cfg.train.num_steps == 300000 and type(cfg.train.num_steps) is int
    assert cfg.train.optim.lr == 1.0 and type(cfg.train.optim.lr) is float
    assert cfg.train.optim.betas == (0.8, 1.0)
    assert cfg.train.optim.schedule == "cosine"
    assert cfg.train.run_dir == Path("/tmp/r")
    assert cfg.train.tags == ["a", "b"]
    assert cfg.train.extra == {"k": 2}
    assert cfg.train.max_tokens == 7
    assert cfg.train.pair == (2, "b")
    assert cfg.lora == LoraConfig(rank=4)
    assert cfg.sections == {"s1": LoraConfig(rank=2)}
    assert cfg.seed == "auto"


def test_optional_fields_accept_null() -> None:
    data = minimal()
    data["train"]["max_tokens"] = None
    data["lora"] = None
    cfg = from_dict(RunConfig, data)
    assert cfg.train.max_tokens is None and cfg.lora is None


def test_from_dict_rejects_non_dataclass() -> None:
    with pytest.raises(TypeError, match="needs a dataclass type"):
        from_dict(dict, {})


# --- from_dict: errors -----------------------------------------------------------------------------


def test_unknown_key_names_dotted_path_and_valid_keys() -> None:
    data = minimal()
    data["train"]["optim"]["lrr"] = 1.0
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert str(info.value) == (
        "unknown key 'train.optim.lrr' (did you mean 'lr'?); valid keys of train.optim: lr, betas, schedule"
    )


def test_unknown_top_level_key_names_the_class() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'; valid keys of RunConfig: train, lora, sections, seed"):
        from_dict(RunConfig, {**minimal(), "zzz": 1})


def test_missing_required_keys_are_all_named() -> None:
    with pytest.raises(ConfigError, match=r"missing required keys 'train.num_steps' \(int\), 'train.optim' \("):
        from_dict(RunConfig, {"train": {}})
    with pytest.raises(ConfigError, match=r"missing required key 'train' \(TrainConfig\)"):
        from_dict(RunConfig, {})


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("optim", "lr", "abc", "train.optim.lr: expected float, got str 'abc'"),
        ("optim", "lr", True, "train.optim.lr: expected float, got bool True"),
        (None, "num_steps", 1.5, "train.num_steps: expected int, got float 1.5"),
        (None, "num_steps", True, "train.num_steps: expected int, got bool True"),
        (None, "num_steps", "10", "train.num_steps: expected int, got str '10'"),
        (None, "use_kl", "yes", "train.use_kl: expected bool (true or false), got str 'yes'"),
        (None, "use_kl", 1, "train.use_kl: expected bool (true or false), got int 1"),
        (None, "name", 1.1, "train.name: expected str, got float 1.1; quote it in YAML to keep it text: '1.1'"),
        (None, "name", ["a"], "train.name: expected str, got list ['a']"),
        (None, "run_dir", 3, "train.run_dir: expected a path (str), got int 3"),
        (None, "tags", "a", "train.tags: expected a list (list[str]), got str 'a'"),
        (None, "tags", ["a", 2], "train.tags[1]: expected str, got int 2; quote it in YAML to keep it text: '2'"),
        (None, "extra", [1], "train.extra: expected a mapping, got list [1]"),
        (None, "extra", {"k": "v"}, "train.extra.k: expected int, got str 'v'"),
        (None, "extra", {1: 1}, "train.extra: keys must be strings, got int 1; quote the key in YAML"),
        (None, "max_tokens", "x", "train.max_tokens: expected int, got str 'x'"),
        (None, "pair", [1], r"train.pair: expected a list of 2 items (tuple[int, str]), got 1 items"),
        ("optim", "betas", [0.9, "x"], "train.optim.betas[1]: expected float, got str 'x'"),
        ("optim", "schedule", "linear", "train.optim.schedule: expected one of 'constant', 'cosine'; got str 'linear'"),
        (None, "optim", 3, "train.optim: expected a mapping (section OptimConfig), got int 3"),
    ],
)
def test_type_errors_name_path_expected_and_got(section: str | None, key: str, value: object, message: str) -> None:
    data = minimal()
    target = data["train"] if section is None else data["train"][section]
    target[key] = value
    with pytest.raises(ConfigError) as info:
        from_dict(RunConfig, data)
    assert str(info.value) == message


def test_union_of_several_types_names_them_all() -> None:
    with pytest.raises(ConfigError, match=r"^seed: expected int \| str, got list \[1\]$"):
        from_dict(RunConfig, {**minimal(), "seed": [1]})


def test_literal_does_not_confuse_bool_with_int() -> None:
    @dataclass(kw_only=True, frozen=True)
    class Choice:
        n: Literal[1, 2]

    assert from_dict(Choice, {"n": 2}).n == 2
    with pytest.raises(ConfigError, match=r"n: expected one of 1, 2; got bool True"):
        from_dict(Choice, {"n": True})


def test_post_init_value_error_becomes_config_error_with_section() -> None:
    data = minimal()
    data["train"]["optim"]["lr"] = -1
    with pytest.raises(ConfigError, match=r"^train.optim: lr must be positive, got -1.0$"):
        from_dict(RunConfig, data)


def test_post_init_error_at_top_level_names_the_class() -> None:
    with pytest.raises(ConfigError, match=r"^OptimConfig: lr must be positive"):
        from_dict(OptimConfig, {"lr": 0})


def test_section_that_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^train: expected a mapping \(section TrainConfig\), got list \[\]$"):
        from_dict(RunConfig, {"train": []})
    with pytest.raises(ConfigError, match=r"^RunConfig: expected a mapping of keys, got list \[\]$"):
        from_dict(RunConfig, [])  # type: ignore[arg-type]


def test_unsupported_annotation_is_a_programming_error() -> None:
    @dataclass(kw_only=True, frozen=True)
    class Bad:
        value: complex

    with pytest.raises(TypeError, match="config field type .* is not supported"):
        from_dict(Bad, {"value": 1})


def test_init_false_fields_are_not_keys() -> None:
    @dataclass(kw_only=True, frozen=True)
    class Derived:
        a: int
        b: int = field(init=False, default=0)

    assert from_dict(Derived, {"a": 1}).a == 1
    with pytest.raises(ConfigError, match=r"unknown key 'b'; valid keys of Derived: a"):
        from_dict(Derived, {"a": 1, "b": 2})
    assert to_dict(from_dict(Derived, {"a": 1})) == {"a": 1}


# --- to_dict / dump_yaml ---------------------------------------------------------------------------


def test_to_dict_gives_plain_values() -> None:
    cfg = from_dict(RunConfig, {**minimal(), "lora": {"rank": 2}})
    data = to_dict(cfg)
    assert data["train"]["run_dir"] == "runs"
    assert data["train"]["optim"]["betas"] == [0.9, 0.95]
    assert data["train"]["pair"] == [1, "a"]
    assert data["lora"] == {"rank": 2}


def test_to_dict_rejects_unknown_objects() -> None:
    @dataclass(kw_only=True, frozen=True)
    class Odd:
        value: object

    with pytest.raises(TypeError, match="cannot turn complex 1j into YAML"):
        to_dict(Odd(value=1j))
    with pytest.raises(TypeError, match="to_dict needs a dataclass instance, got dict"):
        to_dict({"x": 1})


def test_dump_yaml_round_trips_through_load(tmp_path: Path) -> None:
    # Strings that YAML 1.1 or the 1.2 loader would read as non-strings must come back as strings.
    tricky = ["yes", "no", "on", "1e-4", "0o17", "012", "null", "~", "1:20", "1_0", ".5", "true", "x y"]
    data = minimal()
    data["train"].update({"tags": tricky, "name": "1e5", "extra": {"yes": 1}, "max_tokens": 5})
    data["train"]["optim"]["lr"] = 1e-5
    cfg = from_dict(RunConfig, data)
    text = dump_yaml(cfg)
    assert text.startswith("train:\n  num_steps: 10\n  optim:\n    lr: 1.0e-05\n")
    assert from_dict(RunConfig, load_yaml(write(tmp_path, text))) == cfg


# --- load_yaml -------------------------------------------------------------------------------------


def test_load_yaml_uses_yaml_12_scalars(tmp_path: Path) -> None:
    text = "lr: 1e-4\nbig: 3E5\nflag: yes\non: off\nt: True\noct: 012\ntime: 1:20\nn: 1_000\nh: 0x1f\ninf: -.inf\n"
    data = load_yaml(write(tmp_path, text))
    assert data == {
        "lr": 1e-4,
        "big": 3e5,
        "flag": "yes",
        "on": "off",
        "t": True,
        "oct": 12,
        "time": "1:20",
        "n": 1000,
        "h": 31,
        "inf": -math.inf,
    }


def test_yes_for_a_bool_field_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  num_steps: 1\n  use_kl: yes\n  optim: {lr: 1e-4}\n")
    with pytest.raises(ConfigError, match=r"train.use_kl: expected bool \(true or false\), got str 'yes'"):
        load_config(RunConfig, path)


def test_load_yaml_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"config file not found: {tmp_path}/nope.yaml"):
        load_yaml(tmp_path / "nope.yaml")


def test_load_yaml_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config path is a directory"):
        load_yaml(tmp_path)


def test_load_yaml_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_yaml(path)


def test_bad_indentation_reports_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  num_steps: 1\n optim: 2\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    message = str(info.value)
    assert message.startswith(f"invalid YAML in {path} at line 3, column 2: ")
    assert "expected <block end>" in message


def test_unclosed_bracket_reports_position(tmp_path: Path) -> None:
    path = write(tmp_path, "a: [1, 2\nb: 3\n")
    with pytest.raises(ConfigError, match=rf"invalid YAML in {path} at line \d+, column \d+: .*flow sequence"):
        load_yaml(path)


def test_duplicate_key_is_an_error_with_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "a: 1\nb: 2\na: 3\n")
    with pytest.raises(ConfigError, match=r"at line 3, column 1: .*duplicate key 'a' \(first defined on line 1\)"):
        load_yaml(path)


def test_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    data = load_yaml(write(tmp_path, "base: &b {x: 1, y: 2}\nderived:\n  <<: *b\n  y: 3\n"))
    assert data["derived"] == {"x": 1, "y": 3}


@pytest.mark.parametrize(("text", "got"), [("", "is empty"), ("- a\n- b\n", "got list"), ("3\n", "got int 3")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, got: str) -> None:
    with pytest.raises(ConfigError, match=got):
        load_yaml(write(tmp_path, text))


# --- apply_overrides -------------------------------------------------------------------------------


def test_override_nested_key_parses_yaml_values_and_does_not_mutate() -> None:
    data = minimal()
    result = apply_overrides(
        data,
        ["train.optim.lr=1e-4", "train.num_steps=3e5", "train.use_kl=true", "train.tags=[a, b]", "train.name=a=b"],
        cls=RunConfig,
    )
    assert result["train"]["optim"]["lr"] == 1e-4
    assert result["train"]["num_steps"] == 3e5
    assert result["train"]["use_kl"] is True
    assert result["train"]["tags"] == ["a", "b"]
    assert result["train"]["name"] == "a=b"
    assert data == minimal()


@pytest.mark.parametrize(
    ("text", "value"), [("1e-4", 1e-4), ("3e5", 3e5), ("-2.5E-3", -2.5e-3), ("7", 7), ("yes", "yes")]
)
def test_override_numbers_and_strings(text: str, value: object) -> None:
    result = apply_overrides({}, [f"x={text}"])
    assert result["x"] == value and type(result["x"]) is type(value)


def test_override_empty_string_and_null() -> None:
    assert apply_overrides({}, ["a=''", "b=", "c=null"]) == {"a": "", "b": None, "c": None}


def test_override_creates_missing_and_null_sections() -> None:
    result = apply_overrides({"lora": None}, ["lora.rank=4", "train.optim.lr=0.1"], cls=RunConfig)
    assert result == {"lora": {"rank": 4}, "train": {"optim": {"lr": 0.1}}}


def test_override_without_equals_shows_expected_form() -> None:
    with pytest.raises(ConfigError, match=r"override 'train.lr' has no '='; expected the form a.b.c=value"):
        apply_overrides({}, ["train.lr"])


@pytest.mark.parametrize("override", ["=1", "a..b=1", ".a=1", "a.=1"])
def test_override_with_empty_key_part(override: str) -> None:
    with pytest.raises(ConfigError, match="has an empty key part; expected the form"):
        apply_overrides({}, [override])


def test_override_unknown_key_lists_valid_keys_even_when_absent_from_yaml() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, ["train.optim.lrr=1"], cls=RunConfig)
    assert str(info.value) == (
        "override 'train.optim.lrr=1': unknown key 'train.optim.lrr' (did you mean 'lr'?); "
        "valid keys of train.optim: lr, betas, schedule"
    )


def test_override_unknown_top_level_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'tran' \(did you mean 'train'\?\); valid keys of RunConfig"):
        apply_overrides({}, ["tran.num_steps=1"], cls=RunConfig)


def test_override_inside_a_scalar_field_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'train.num_steps' has type int, not a section; set it as a whole"):
        apply_overrides({}, ["train.num_steps.x=1"], cls=RunConfig)


def test_override_into_dict_field_accepts_free_keys_and_checks_dataclass_values() -> None:
    result = apply_overrides({}, ["train.extra.anything=3", "sections.s1.rank=2", "lora.rank=1"], cls=RunConfig)
    assert result["train"]["extra"] == {"anything": 3}
    with pytest.raises(ConfigError, match=r"unknown key 'sections.s1.rnk' \(did you mean 'rank'\?\)"):
        apply_overrides({}, ["sections.s1.rnk=2"], cls=RunConfig)


def test_override_without_cls_refuses_to_descend_into_a_scalar() -> None:
    with pytest.raises(ConfigError, match=r"cannot set a key inside 'a.b', which is int 3, not a mapping"):
        apply_overrides({"a": {"b": 3}}, ["a.b.c=1"])


def test_override_with_malformed_value() -> None:
    with pytest.raises(ConfigError, match=r"invalid YAML in the value of override 'a=\[1, 2'"):
        apply_overrides({}, ["a=[1, 2"])


def test_overrides_must_be_a_sequence_of_strings() -> None:
    with pytest.raises(TypeError, match="single string"):
        apply_overrides({}, "a=1")


# --- load_config -----------------------------------------------------------------------------------


def test_load_config_combines_file_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  num_steps: 5\n  optim:\n    lr: 1e-3\n")
    cfg = load_config(RunConfig, path, ["train.optim.lr=2e-4", "lora.rank=16"])
    assert cfg.train.num_steps == 5
    assert cfg.train.optim.lr == 2e-4
    assert cfg.lora == LoraConfig(rank=16)


def test_load_config_type_error_from_override(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  num_steps: 5\n  optim:\n    lr: 1e-3\n")
    with pytest.raises(ConfigError, match=r"^train.optim.lr: expected float, got str 'abc'$"):
        load_config(RunConfig, path, ["train.optim.lr=abc"])
