#!/usr/bin/env python3
"""Every `--flag` that a message in src/ names is a flag the `moeinfer` command defines.

Issue 12, item 3: error messages name only flags that exist. A hint such as "lower the tokens per
step (--max-batch-tokens)" is worse than none when the flag is really --max-num-batched-tokens.

How it works:

  1. The CLI's real flags come from the built command itself: `moeinfer --help` lists the
     subcommands, `moeinfer SUB --help` lists each one's flags (and nested subcommands, such as
     `trace summarize`, whose flags count as the parent's). No hand-written list.
  2. Every C++ string literal in src/**/*.{cpp,h,cu,cuh} is extracted by a small lexer that
     skips comments, character literals and digit separators (1'000) and understands raw strings
     R"x(...)x"; adjacent literals are joined as the compiler joins them, so a flag split over
     two literals is still seen whole. `--name` tokens inside a literal (not preceded by a
     letter, digit, `-` or `_`, so "---" rules and `a--b` are not flags) are the flags it names.
  3. Scope: a literal in src/cli/cmd_NAME.cpp must name a flag of subcommand NAME (`_` -> `-`),
     because only that subcommand reaches the file's messages; a literal anywhere else (the
     engine, the server, the shared cli/device_arg.cpp and cli/model_arg.cpp) must name a flag
     of at least one subcommand, because which subcommands reach a library message is not
     cheap to know.
  4. ALLOWED lists the `--` tokens in literals that are not moeinfer flags, each with the
     reason it is there (today: the CSS custom properties of the profile report's stylesheet);
     CROSS_REFS the places where one subcommand's text names another's flag on purpose. An
     entry that no longer matches anything fails too, so the lists cannot go stale.

Any other flag fails the test with `FILE:LINE: --flag ...` for each, naming the subcommand(s)
it was checked against. Beside it, did_you_mean checks that a misspelt subcommand or flag fails
with the name it was probably meant to be. Prints one line per check and a last line
"N passed, M failed".
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}

# A flag inside a string literal: two dashes after a non-word, non-dash character (or the start),
# then a letter, then letters, digits and dashes; a trailing dash is not part of the name.
FLAG = re.compile(r"(?<![A-Za-z0-9_-])--([A-Za-z][A-Za-z0-9-]*[A-Za-z0-9]|[A-Za-z])")

# (path relative to src/, token) -> why this `--` token in a literal is not a moeinfer flag.
ALLOWED: dict[tuple[str, str], str] = {
    **{("profile/report_html.cpp", css): "a CSS custom property of the profile report's "
       "stylesheet (kStyle: `:root { --ink:... }`, `var(--ink)`)"
       for css in ("--ink", "--muted", "--line", "--card", "--bg", "--accent")},
}

# (path relative to src/, token) -> the subcommand whose flag a cmd_*.cpp text names on purpose.
CROSS_REFS: dict[tuple[str, str], str] = {
    ("cli/cmd_trace.cpp", "--trace-routing"): "generate",  # `trace`'s help: who writes the file
    ("cli/cmd_plan.cpp", "--ep"): "serve",  # `plan`'s note: CPU ranks shard experts
    ("cli/cmd_placement.cpp", "--trace-routing"): "generate",  # who writes the trace it reads
    ("cli/cmd_placement.cpp", "--placement"): "logits",  # who reads the file it writes
}


@dataclass
class Literal:
    text: str  # contents, escapes left as written; adjacent literals joined
    pieces: list[tuple[int, int]] = field(default_factory=list)  # (offset in text, source line)

    def line_of(self, offset: int) -> int:
        start, line = max(p for p in self.pieces if p[0] <= offset)
        return line + self.text.count("\n", start, offset)


def string_literals(source: str) -> list[Literal]:
    """The string literals of one C++ source, adjacent ones joined; comments skipped."""
    out: list[Literal] = []
    i, n, line = 0, len(source), 1
    joinable = False  # the last token was a string literal (only whitespace/comments since)

    def add(start_line: int, text: str) -> None:
        nonlocal joinable
        if not (joinable and out):
            out.append(Literal(""))
        out[-1].pieces.append((len(out[-1].text), start_line))
        out[-1].text += text
        joinable = True

    while i < n:
        c = source[i]
        if c == "\n":
            line += 1
            i += 1
        elif c in " \t\r\f\v\\":
            i += 1
        elif source.startswith("//", i):
            end = source.find("\n", i)
            i = n if end < 0 else end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            line += source.count("\n", i, end)
            i = end
        elif c == "#" and source[source.rfind("\n", 0, i) + 1:i].strip() == "":
            # A preprocessor directive. A #define body is code and is lexed as such; the rest
            # (#include "file", #if, #error text) holds no messages the program prints.
            if re.match(r"#\s*define\b", source[i:i + 64]):
                i += 1
            else:
                end = i
                while True:  # to the end of the line, backslash continuations included
                    end = source.find("\n", end)
                    if end < 0 or source[end - 1] != "\\":
                        break
                    end += 1
                    line += 1
                i = n if end < 0 else end
            joinable = False
        elif c == '"':
            start_line = line
            j = i + 1
            while j < n and source[j] != '"':
                if source[j] == "\\":
                    j += 1
                if j < n and source[j] == "\n":
                    line += 1
                j += 1
            add(start_line, source[i + 1:j])
            i = j + 1
        elif c == "'":
            j = i + 1
            while j < n and source[j] != "'":
                if source[j] == "\\":
                    j += 1
                j += 1
            i = j + 1
            joinable = False
        elif c.isalpha() or c == "_":
            m = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(source, i)
            word = m.group(0)
            j = m.end()
            if j < n and source[j] == '"' and word in ("R", "u8R", "uR", "UR", "LR"):
                delim_end = source.find("(", j + 1)
                delim = source[j + 1:delim_end]
                close = source.find(")" + delim + '"', delim_end)
                assert close >= 0, f"unterminated raw string at line {line}"
                start_line = line
                body = source[delim_end + 1:close]
                line += body.count("\n")
                add(start_line, body)
                i = close + len(delim) + 2
            elif j < n and source[j] == '"' and word in ("u8", "u", "U", "L"):
                i = j  # an encoding prefix: the literal follows
            else:
                i = j
                joinable = False
        elif c.isdigit() or (c == "." and i + 1 < n and source[i + 1].isdigit()):
            # A pp-number, digit separators included: 1'000'000, 0x1p-3, 1e+5.
            m = re.compile(r"\.?[0-9](?:[eEpP][+-]|'[0-9A-Za-z]|[0-9A-Za-z_.])*").match(source, i)
            i = m.end()
            joinable = False
        else:
            i += 1
            joinable = False
    return out


def named_flags(root: pathlib.Path) -> list[tuple[str, int, str]]:
    """(path relative to src/, line, --flag) for every flag named in a string literal."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        try:
            literals = string_literals(path.read_text(encoding="utf-8", errors="replace"))
        except AssertionError as error:
            raise AssertionError(f"src/{rel}: {error}") from None
        for literal in literals:
            for m in FLAG.finditer(literal.text):
                line = literal.line_of(m.start())
                found.append((rel, line, "--" + m.group(1)))
    return found


def help_sections(moeinfer: str, path: list[str]) -> dict[str, list[str]]:
    """The first column of each section ("Options:", "Subcommands:") of `moeinfer PATH --help`."""
    proc = subprocess.run([moeinfer, *path, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"`moeinfer {' '.join(path)} --help` exited {proc.returncode}: " \
                                 f"{proc.stderr}"
    sections: dict[str, list[str]] = {}
    current = None
    for line in proc.stdout.splitlines():
        if re.match(r"^[A-Z][A-Za-z ]*:$", line):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and re.match(r"^  \S", line):
            # An entry: its name column (wrapped descriptions are indented much further).
            current.append(line.split()[0])
    return sections


def option_flags(sections: dict[str, list[str]]) -> set[str]:
    """The --flags of an "Options:" section: `-h,--help`, `--port`, `--no-prefix-caching{false}`."""
    return {m.group(0) for entry in sections.get("Options", []) for name in entry.split(",")
            if (m := re.match(r"--[A-Za-z0-9][A-Za-z0-9_-]*", name))}


def root_flags(moeinfer: str) -> set[str]:
    """The flags of `moeinfer` itself (--help, --version)."""
    return option_flags(help_sections(moeinfer, []))


def cli_flags(moeinfer: str) -> dict[str, set[str]]:
    """Each top-level subcommand's flags, its nested subcommands' included, from --help."""
    def collect(path: list[str]) -> set[str]:
        sections = help_sections(moeinfer, path)
        flags = option_flags(sections)
        for sub in sections.get("Subcommands", []):
            flags |= collect([*path, sub])
        return flags

    subcommands = help_sections(moeinfer, []).get("Subcommands", [])
    assert subcommands, "`moeinfer --help` lists no subcommands"
    return {sub: collect([sub]) for sub in subcommands}


def scope(rel: str, subcommands: dict[str, set[str]]) -> list[str] | None:
    """The subcommands whose flags a literal in src/REL may name; None: any (the union)."""
    m = re.fullmatch(r"cli/cmd_(\w+)\.cpp", rel)
    if not m:
        return None
    sub = m.group(1).replace("_", "-")
    return [sub] if sub in subcommands else []


def check_lexer() -> None:
    source = textwrap.dedent("""\
        // "--in-comment" is skipped
        /* "--in-block-comment"
           is skipped */ int x = 1'000'000; char c = '"'; char d = '\\'';
        #include "--not-a-literal.h"
        #error "--not-a-message" \\
               "--continued"
        #define MSG "--in-define"
        const char* a = "one --first " "and --second"
                        "\\"--third\\" ---- a--b --x";
        const char* b = R"x(raw "--raw-flag" )" --after)x"; f(--i);
        const char* c2 = u8"--encoded";
        """)
    literals = string_literals(source)
    texts = [lit.text for lit in literals]
    assert len(texts) == 4, texts
    got = [(lit.line_of(m.start()), m.group(0)) for lit in literals
           for m in FLAG.finditer(lit.text)]
    want = [(7, "--in-define"), (8, "--first"), (8, "--second"), (9, "--third"), (9, "--x"),
            (10, "--raw-flag"), (10, "--after"), (11, "--encoded")]
    assert got == want, f"lexer found {got}, expected {want}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moeinfer", required=True)
    parser.add_argument("--fixtures", help="unused; ctest passes it to every e2e script")
    parser.add_argument("--src", type=pathlib.Path,
                        default=pathlib.Path(__file__).resolve().parent.parent.parent / "src",
                        help="source tree to scan (default: this checkout's src/)")
    args = parser.parse_args()
    src = args.src

    passed = failed = 0

    def report(name: str, check) -> object:
        nonlocal passed, failed
        try:
            result = check()
            print(f"ok   {name}")
            passed += 1
            return result
        except Exception as error:  # noqa: BLE001 - each check reports its own failure
            print(f"FAIL {name}: {error}")
            failed += 1
            return None

    def check_did_you_mean() -> None:
        # A misspelt subcommand or flag fails with the name it was probably meant to be.
        for argv, hint in ((["genrate", "--prompt", "x"], "did you mean 'generate'?"),
                           (["generate", "--prmpt", "x"], "--prmpt: did you mean --prompt?"),
                           (["bench", "--batchh", "2"], "--batchh: did you mean --batch?")):
            run = subprocess.run([args.moeinfer, *argv], capture_output=True, text=True,
                                 timeout=60)
            assert run.returncode != 0 and hint in run.stderr, (argv, run.returncode, run.stderr)

    report("did_you_mean", check_did_you_mean)
    report("lexer_self_check", check_lexer)
    subcommands = report("cli_flags_from_help", lambda: cli_flags(args.moeinfer))
    named = report("string_literals_scanned", lambda: named_flags(src))
    if subcommands is None or named is None:
        print(f"{passed} passed, {failed + 1} failed")
        return 1
    # A message outside cmd_*.cpp may name the command's own flags too (main.cpp: --version).
    every_flag = set().union(root_flags(args.moeinfer), *subcommands.values())
    print(f"  {len(subcommands)} subcommands, {len(every_flag)} distinct flags; "
          f"{len(named)} flags named in string literals of src/")

    def check_named() -> None:
        bad = []
        used_allowed, used_cross = set(), set()
        for rel, line, flag in named:
            if (rel, flag) in ALLOWED:
                used_allowed.add((rel, flag))
                continue
            subs = scope(rel, subcommands)
            if subs is not None and (rel, flag) in CROSS_REFS:
                used_cross.add((rel, flag))
                subs = [CROSS_REFS[(rel, flag)]]
            if subs is None:
                if flag not in every_flag:
                    bad.append(f"src/{rel}:{line}: {flag} is a flag of no moeinfer subcommand")
            elif not subs:
                bad.append(f"src/{rel}:{line}: {flag}: the file names no subcommand of "
                           f"`moeinfer --help` (cmd_NAME.cpp is subcommand NAME); see scope()")
            elif not any(flag in subcommands[sub] for sub in subs):
                owners = sorted(sub for sub, flags in subcommands.items() if flag in flags)
                bad.append(f"src/{rel}:{line}: {flag} is not a flag of `moeinfer "
                           f"{' / '.join(subs)}` (defined on: {', '.join(owners) or 'none'})")
        for key in sorted(set(ALLOWED) - used_allowed):
            bad.append(f"ALLOWED entry {key} matches nothing any more: remove it")
        for key in sorted(set(CROSS_REFS) - used_cross):
            bad.append(f"CROSS_REFS entry {key} matches nothing any more: remove it")
        assert not bad, f"{len(bad)} problem(s):\n  " + "\n  ".join(bad)

    report("named_flags_exist", check_named)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
