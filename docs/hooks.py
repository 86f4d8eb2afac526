"""MkDocs hooks: the pages that are generated at build time, so that they cannot drift.

- ``cli.md``: every ``memfit`` command's usage and options, walked from the argparse parser that the
  command line itself runs (:func:`memfit.cli.main.build_parser`).
- ``zoo.md``: the model-zoo table, read with :mod:`ast` from ``tests/zoo/test_zoo.py`` (its
  ``FAMILIES`` and the functions that build them, ``CHAINS``, ``BATCHNORM``, ``MOE``,
  ``FLOAT32_INSIDE`` and ``REFUSED``); the test module is parsed, not imported, so the docs build
  needs neither pytest nor the zoo's libraries.
- ``zoo.md``, second table: read the same way from ``tests/zoo/test_zoo_towers.py`` (models whose
  blocks are not one stack: towers, skip connections).
- ``benchmarks/``: ``benchmarks/README.md`` and the reports it indexes (``benchmarks/reports/``, written
  by ``benchmarks/make_reports.py``), with the result files they link to, as pages of the site.

A page asks for a generated part with a marker line: ``<!-- generated: cli -->``,
``<!-- generated: zoo -->``, ``<!-- generated: zoo_towers -->`` or ``<!-- generated: benchmarks -->``.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "tests" / "zoo" / "test_zoo.py"
ZOO_TOWERS = ROOT / "tests" / "zoo" / "test_zoo_towers.py"
BENCHMARKS = ROOT / "benchmarks"
MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)


# --------------------------------------------------------------------------------------------------
# MkDocs events


def on_files(files, config):
    """Add ``benchmarks/README.md`` (as ``benchmarks/index.md``), its reports and their result files."""
    # imported here so that the generators below run without MkDocs (tests/test_docs.py calls them)
    from mkdocs.structure.files import File

    files.append(File.generated(config, "benchmarks/index.md", abs_src_path=str(BENCHMARKS / "README.md")))
    for path in sorted((BENCHMARKS / "reports").glob("*.md")):
        files.append(File.generated(config, f"benchmarks/reports/{path.name}", abs_src_path=str(path)))
    for path in sorted((BENCHMARKS / "results").glob("*")):
        if path.is_file() and path.suffix in {".json", ".png"}:
            files.append(File.generated(config, f"benchmarks/results/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


# --------------------------------------------------------------------------------------------------
# The CLI reference


def cli_reference() -> str:
    from memfit.cli.main import build_parser

    parser = build_parser()
    parser.prog = "memfit"
    lines = [_usage(parser), "", *_options(parser, skip=("-h",))]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        lines += [f"## memfit {name}", "", _sentence(helps.get(name) or p.description or ""), "", _usage(p), ""]
        lines += _options(p, skip=("-h",))
    return "\n".join(lines)


def _usage(p: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(p.prog, width=100)
    formatter.add_usage(p.usage, p._actions, p._mutually_exclusive_groups, prefix="")
    return "```text\n" + formatter.format_help().strip() + "\n```"


def _options(p: argparse.ArgumentParser, *, skip: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for group in p._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._SubParsersAction)
            and not set(a.option_strings) & set(skip)
        ]
        if not actions:
            continue
        title = {"positional arguments": "Arguments", "options": "Options"}.get(group.title, _sentence(group.title))
        out += [f"**{title}**", "", "| option | meaning |", "|---|---|"]
        for a in actions:
            out.append(f"| {_flags(a)} | {_cell(_help(a))} |")
        out.append("")
    return out


def _flags(a: argparse.Action) -> str:
    if not a.option_strings:
        return f"`{a.metavar or a.dest}`"
    takes_value = a.nargs != 0
    metavar = a.metavar or (a.dest.upper() if takes_value else "")
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if takes_value and a.choices is not None and a.metavar is None:
        metavar = "{" + ",".join(map(str, a.choices)) + "}"
    return ", ".join(f"`{s} {metavar}`".replace(" `", "`") if takes_value else f"`{s}`" for s in a.option_strings)


def _help(a: argparse.Action) -> str:
    text = (a.help or "").replace("%(default)s", str(a.default)).replace("%%", "%")
    if "%(" in text:
        text = text % {**vars(a), "prog": "memfit"}
    if a.default not in (None, False, argparse.SUPPRESS, [], "") and "default" not in text and a.nargs != 0:
        text += f" (default: `{a.default}`)"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".") if text else ""


# --------------------------------------------------------------------------------------------------
# The model zoo


def zoo_table() -> str:
    tree = ast.parse(ZOO.read_text())
    source = ZOO.read_text()
    top = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    assigned = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    families = {k.value: v.id for k, v in zip(assigned["FAMILIES"].keys, assigned["FAMILIES"].values, strict=True)}
    chains = _evaluate(assigned["CHAINS"])
    batchnorm = ast.literal_eval(assigned["BATCHNORM"])
    moe = ast.literal_eval(assigned["MOE"])
    float32_inside = ast.literal_eval(assigned["FLOAT32_INSIDE"])
    kinds = {
        "_causal_lm": "causal LM: token rows of random length, right-padded, `labels` (-100 on padding)",
        "_seq2seq": "encoder-decoder: inputs and decoder `labels`",
        "_classifier": "classifier: `labels` per sample",
    }
    doc = ast.get_docstring(tree) or ""
    steps = doc[doc.index("For each family:") : doc.index("\n\n", doc.index("1. "))]
    lines = [
        steps.replace("``", "`"),
        "",
        "| family | built as | called as | checked beyond the common checks |",
        "|---|---|---|---|",
    ]
    for family, fn_name in families.items():
        fn = top[fn_name]
        built = sorted({_dotted(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)})
        classes = [b for b in built if b.startswith(("transformers.", "peft."))]
        kind = next((kinds[b] for b in built if b in kinds), "")
        comments = " ".join(
            line.strip().lstrip("# ").strip()
            for line in ast.get_source_segment(source, fn).splitlines()
            if line.strip().startswith("#")
        )
        extra = []
        if family in chains:
            extra.append(f"chain found across containers: `{chains[family]}`")
        if family in batchnorm:
            extra.append("BatchNorm: accumulation checked with `bn='freeze'` (micro-batch statistics by design)")
        if family in moe:
            extra.append("MoE: router jitter and the load-balancing loss off for the float64 accumulation check")
        if family in float32_inside:
            extra.append(f"float32 inside: {float32_inside[family]}")
        if comments:
            extra.append(comments)
        lines.append(
            f"| {family} | {', '.join(f'`{c}`' for c in classes)} | {kind} | {_cell('; '.join(extra)) or '-'} |"
        )
    refused = assigned["REFUSED"]
    lines += ["", "Refused by design, at profile time, with one line that says why and what to do:", ""]
    lines += ["| family | the message matches |", "|---|---|"]
    for key, value in zip(refused.keys, refused.values, strict=True):
        pattern = ast.literal_eval(value.elts[1])
        lines.append(f"| {key.value} | `{_cell(pattern)}` |")
    consts = _tuple_consts(tree)
    lines += [
        "",
        f"Sizes: width {consts['WIDTH']}, {consts['LAYERS']} blocks, vocabulary {consts['VOCAB']}, batch "
        f"{consts['B']} x {consts['T']} tokens; prediction tolerance "
        f"{ast.literal_eval(assigned['PREDICTION_RTOL']):.0%} (`PREDICTION_RTOL`).",
    ]
    return "\n".join(lines)


def zoo_towers_table() -> str:
    """The second zoo table, read with :mod:`ast` from ``tests/zoo/test_zoo_towers.py`` (its
    ``FAMILIES``, the functions that build them, ``CHAINS``, ``LEFT_OUT`` and ``MIN_COVERAGE``)."""
    source = ZOO_TOWERS.read_text()
    tree = ast.parse(source)
    top = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assigned = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    families = {k.value: v.id for k, v in zip(assigned["FAMILIES"].keys, assigned["FAMILIES"].values, strict=True)}
    chains = _evaluate(assigned["CHAINS"], ZOO_TOWERS)
    left_out = ast.literal_eval(assigned["LEFT_OUT"])
    coverage = ast.literal_eval(assigned["MIN_COVERAGE"])
    doc = ast.get_docstring(tree) or ""
    steps = doc[doc.index("For each family:") : doc.index("\n\n", doc.index("2. "))]
    lines = [
        steps.replace("``", "`"),
        "",
        "| family | built as | chain profiled (forward order) | coverage at least | notes |",
        "|---|---|---|---|---|",
    ]
    for family, fn_name in families.items():
        fn = top[fn_name]
        built = sorted({_dotted(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)})
        made = [f"`{b}`" for b in built if b.startswith("transformers.") and not b.endswith("Config")]
        made += [f"plain torch (`{b}`)" for b in built if b in classes]
        comments = " ".join(
            line.strip().lstrip("# ").strip()
            for line in ast.get_source_segment(source, fn).splitlines()
            if line.strip().startswith("#")
        )
        notes = [comments.rstrip(".")] if comments else []
        if family in left_out:
            notes.append(f"left out and named: `{left_out[family]}`")
        lines.append(
            f"| {family} | {', '.join(made)} | `{_cell(chains[family])}` | {coverage[family]:.0%} | "
            f"{_cell('; '.join(notes)) or '-'} |"
        )
    return "\n".join(lines)


def _evaluate(node: ast.expr, path: Path = ZOO) -> object:
    """A literal whose values may be joins of f-strings over ``range``: evaluated with nothing else in scope."""
    return eval(compile(ast.Expression(node), str(path), "eval"), {"__builtins__": {"range": range}})


def _tuple_consts(tree: ast.Module) -> dict[str, object]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [t.id for t in node.targets[0].elts]
            if "WIDTH" in names:
                return dict(zip(names, ast.literal_eval(node.value), strict=True))
    raise ValueError(f"{ZOO}: no B, T, VOCAB, WIDTH, LAYERS")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


# --------------------------------------------------------------------------------------------------
# Benchmarks


def benchmarks_index() -> str:
    """The index table of ``benchmarks/README.md``, its links pointing at the site's copies."""
    text = (BENCHMARKS / "README.md").read_text()
    table = text[text.index("| report |") :]
    return table.replace("](reports/", "](benchmarks/reports/")


GENERATORS = {"cli": cli_reference, "zoo": zoo_table, "zoo_towers": zoo_towers_table, "benchmarks": benchmarks_index}
