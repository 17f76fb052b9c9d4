"""Weight versions across the engine boundary: an int inside hpcrl, a string on the wire.

SGLang's contract carries a weight version as a string (`--weight-version`, `/update_weight_version`'s
`new_version`, `meta_info.weight_version`, `/model_info`), and the embedded engine speaks the same. Inside hpcrl a
version is the number of optimizer steps behind the weights (0: the weights before any GRPO step). This module is
the one place that turns one into the other: the client formats what it sends with `format_weight_version` and
reads every version an engine answers with `parse_weight_version` (a ValueError naming the engine and the field
for an answer that is not a version; the client raises it as an EngineRequestError).
"""

from __future__ import annotations

from hpcrl.engine.protocol.answers import DEFAULT_WEIGHT_VERSION, GenerateResult

__all__ = ["format_weight_version", "parse_weight_version", "token_weight_versions"]


def format_weight_version(version: int) -> str:
    """The wire's string for weight version `version` (what `/update_weight_version` sends)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"a weight version is an int >= 0 (optimizer steps behind the weights), got {version!r}")
    return str(version)


def parse_weight_version(text: object, *, url: str, field: str) -> int:
    """The version an engine answered in `field`. SGLang's "default" (an engine started without
    `--weight-version`, before any update: the weights it loaded) is 0; anything but digits is refused."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text  # a JSON number: not what SGLang sends, but the same version
    if isinstance(text, str):
        if text.isascii() and text.isdigit():
            return int(text)
        if text == DEFAULT_WEIGHT_VERSION:
            return 0
    raise ValueError(
        f"engine {url} answered {field}={text!r}, which is not a weight version: hpcrl starts its engines with "
        "--weight-version 0 and stamps every push with the number of optimizer steps behind its weights, so an "
        "engine reporting anything else was started or stamped by another program; restart it from hpcrl "
        "(or with --weight-version 0)"
    )


def token_weight_versions(r: GenerateResult, url: str) -> list[int | None]:
    """The weight version of every output token of an answer from the engine at `url`: its per-token spans
    (hpcrl's extension), else its one `meta_info.weight_version` for all; None where the engine sent neither."""
    if r.weight_versions is None:
        if r.weight_version is None:
            return [None] * len(r.output_ids)
        version = parse_weight_version(r.weight_version, url=url, field="meta_info.weight_version")
        return [version] * len(r.output_ids)
    out: list[int | None] = []
    for i, span in enumerate(r.weight_versions):
        version = parse_weight_version(span.version, url=url, field=f"meta_info.weight_versions[{i}].version")
        out.extend([version] * (span.end - span.start))
    return out
