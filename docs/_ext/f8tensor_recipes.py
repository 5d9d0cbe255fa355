"""The ``f8tensor-recipes`` directive: the table of named recipes, read from ``f8tensor.RECIPES``.

Generated at build time, so the page always shows what ``Float8LinearConfig.from_recipe``
builds.
"""

from __future__ import annotations

import torch
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from f8tensor import RECIPES, CastConfig, Float8LinearConfig, Granularity

_COLUMNS = ("recipe", "input", "weight", "grad_output", "weight-gradient GEMM", "scaling")


def _cast(cast: CastConfig) -> str:
    dtype = str(cast.dtype).removeprefix("torch.float8_")
    granularity = cast.granularity
    if isinstance(granularity, Granularity):
        shown = granularity.value
    else:
        shown = "x".join(str(b) for b in granularity.block)
        if granularity.scale_dtype != torch.float32:
            shown += f" ({str(granularity.scale_dtype).removeprefix('torch.float8_')} scale)"
    return f"{dtype}, {shown}"


def _row(name: str, config: Float8LinearConfig) -> tuple[str, ...]:
    casts = (config.input, config.weight, config.grad_output)
    scaling = sorted({cast.scaling.value for cast in casts})
    return (
        name,
        *(_cast(cast) for cast in casts),
        "high precision" if config.weight_grad_in_hp else "FP8",
        ", ".join(scaling),
    )


def _table(rows: list[tuple[str, ...]]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(_COLUMNS))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in _COLUMNS)
    head = nodes.thead()
    body = nodes.tbody()
    group += head
    group += body
    for parent, cells in [(head, _COLUMNS), *((body, row) for row in rows)]:
        row_node = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=cell)
            row_node += entry
        parent += row_node
    return table


class RecipesDirective(SphinxDirective):
    """Renders one row per entry of ``f8tensor.RECIPES``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        return [_table([_row(name, config) for name, config in RECIPES.items()])]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("f8tensor-recipes", RecipesDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
