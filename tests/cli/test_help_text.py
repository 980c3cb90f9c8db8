"""``lowrank-jax --help`` and every subcommand's help read as help: plain sentences (no
reStructuredText roles, no backticks), every subcommand named in the description, and a
help text for every option."""

from __future__ import annotations

import argparse
import re

import pytest

from lowrank_jax.cli.main import build_parser

ROLE = re.compile(r"`|:(mod|func|class|meth|attr|data|exc|obj|ref|doc):")


def _subparsers(parser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _all_parsers():
    """``(name, parser)`` for the program and every subcommand (nested ones too)."""
    top = build_parser()
    out = [("lowrank-jax", top)]
    todo = [("lowrank-jax", top)]
    while todo:
        name, parser = todo.pop(0)
        sub = _subparsers(parser)
        for child, child_parser in (sub.choices.items() if sub else ()):
            out.append((f"{name} {child}", child_parser))
            todo.append((f"{name} {child}", child_parser))
    return out


PARSERS = _all_parsers()


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_help_is_plain_text(name, parser):
    text = parser.format_help()
    assert not ROLE.search(text), f"{name} --help: {ROLE.search(text).group(0)!r} in\n{text}"


@pytest.mark.parametrize("name,parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_every_option_has_help(name, parser):
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and not (a.help or "").strip()]
    assert not missing, f"{name}: options without help: {missing}"


def test_the_description_names_every_subcommand():
    top = build_parser()
    commands = list(_subparsers(top).choices)
    assert "frontier" in commands
    for command in commands:
        assert re.search(rf"\b{command}\b", top.description), command


def test_the_role_check_can_fail():
    assert ROLE.search("see :mod:`lowrank_jax.recipes`") and ROLE.search("``x``")
    assert not ROLE.search("see lowrank_jax.recipes.outputs")
