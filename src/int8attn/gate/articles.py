"""The two articles the gate reproduces (docs/design.md §2), named once for every report."""

from __future__ import annotations

#: (role, original title, English translation, what the gate reproduces from it)
ARTICLES = (
    ("first article",
     "gfx936 DCU上实现INT8 QK MMAC：分页访存、Fragment映射与GQA适配",
     "Implementing INT8 QK MMAC on the gfx936 DCU: paged memory access, fragment mapping and GQA adaptation",
     "E3: INT8 K converted to BF16 vs the native INT8 QK product"),
    ("second article",
     None,  # the copy we worked from has no title line; it opens with its summary
     "the gfx936 DCU report of two negative low-precision results, dynamic INT8 GEMM and FP8 KV cache "
     "attention, which opens with 「实验摘要」 (\"Summary of the experiments\")",
     "E1: dynamic INT8 GEMM; E2: FP8 KV decode"),
)


def article_lines() -> list[str]:
    """One Markdown line per article: its title (and translation) and the experiments."""
    out = []
    for role, title, english, what in ARTICLES:
        if title:
            out.append(f"{role}: 《{title}》 (*{english}*) — {what}")
        else:
            out.append(f"{role} (untitled in our copy): {english} — {what}")
    return out
