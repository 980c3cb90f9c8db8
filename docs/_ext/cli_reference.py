"""The command-line reference, generated from the argparse parser of ``lowrank-jax``.

``docs/cli.md`` holds ``{cli-reference}``; this directive renders the program's description
and, for each subcommand (in the order ``--help`` lists them), its description, usage and one
entry per option with its help text, exactly as ``lowrank-jax COMMAND --help`` prints them.
"""

from __future__ import annotations

import argparse

from docutils import nodes
from docutils.parsers.rst import Directive


def _parser() -> argparse.ArgumentParser:
    from lowrank_jax.cli.main import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action
    return None


def _option_rows(parser: argparse.ArgumentParser):
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):  # noqa: SLF001
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or action.dest.upper()
                if isinstance(metavar, tuple):
                    metavar = " ".join(metavar)
                name += f" {metavar}"
        else:
            name = action.metavar or action.dest
        text = (action.help or "") % {"default": action.default, "prog": parser.prog,
                                     "dest": action.dest,
                                     "choices": ", ".join(map(str, action.choices or ()))}
        yield name, text


def _paragraphs(text: str) -> list[nodes.Node]:
    return [nodes.paragraph(text=" ".join(p.split())) for p in (text or "").split("\n\n")
            if p.strip()]


def _options(parser: argparse.ArgumentParser) -> nodes.Node:
    dl = nodes.definition_list()
    for name, text in _option_rows(parser):
        item = nodes.definition_list_item()
        item += nodes.term("", "", nodes.literal(text=name))
        body = nodes.definition()
        body += _paragraphs(text) or [nodes.paragraph(text="")]
        item += body
        dl += item
    return dl


class CliReference(Directive):
    has_content = False

    def run(self):
        parser = _parser()
        out: list[nodes.Node] = []
        out += _paragraphs(parser.description)
        sub = _subparsers(parser)
        for name, command in (sub.choices.items() if sub else ()):
            section = nodes.section(ids=[f"cli-{name}"], names=[f"lowrank-jax {name}"])
            section += nodes.title(text=f"lowrank-jax {name}")
            section += _paragraphs(command.description)
            section += nodes.literal_block(text=command.format_usage().strip(), language="text")
            nested = _subparsers(command)
            if nested:
                for inner, inner_parser in nested.choices.items():
                    sub_section = nodes.section(ids=[f"cli-{name}-{inner}"],
                                                names=[f"lowrank-jax {name} {inner}"])
                    sub_section += nodes.title(text=f"lowrank-jax {name} {inner}")
                    sub_section += _paragraphs(inner_parser.description)
                    sub_section += nodes.literal_block(text=inner_parser.format_usage().strip(),
                                                     language="text")
                    sub_section += _options(inner_parser)
                    section += sub_section
            section += _options(command)
            out.append(section)
        return out


def setup(app):
    app.add_directive("cli-reference", CliReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
