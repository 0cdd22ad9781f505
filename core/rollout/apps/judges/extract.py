"""Finding the code in a response, and checking that it parses before anything runs it.

Python reports a syntax error only when the program runs, as a traceback like any other
crash; parsing first is what tells syntax_error apart from runtime_error.
"""

from __future__ import annotations

import re
import textwrap
import warnings

PYTHON_TAGS = ("python", "py", "python3", "py3")
_OPENING = re.compile(r"(`{3,}|~{3,})\s*([^\s`]*)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown text as (language tag, code). A block left open
    (the response was cut off at its token limit) runs to the end of the text."""
    blocks: list[tuple[str, str]] = []
    fence, tag, body = None, "", []
    for line in text.splitlines():
        stripped = line.strip()
        if fence is None:
            opening = _OPENING.fullmatch(stripped)
            if opening:
                fence, tag, body = opening.group(1), opening.group(2).lower(), []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            blocks.append((tag, textwrap.dedent("\n".join(body))))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        blocks.append((tag, textwrap.dedent("\n".join(body))))
    return blocks


def extract_code(response: str, whole_response: bool = False) -> str | None:
    """The code to judge: the first python block (else the first block without a language
    tag), or the whole response when the problem says so. None when there is no code."""
    if whole_response:
        code = response
    else:
        blocks = fenced_blocks(response)
        chosen = ([code for tag, code in blocks if tag in PYTHON_TAGS]
                  or [code for tag, code in blocks if not tag])
        code = chosen[0] if chosen else ""
    return code if code.strip() else None


def syntax_error(source: str) -> str | None:
    """Why `source` is not a valid Python program, or None if it compiles."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings about the answer are not ours
            compile(source, "solution.py", "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        return f"{type(exc).__name__}: {exc.msg}{where}"
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:
        return f"{type(exc).__name__}: {exc}"  # null bytes, nesting too deep for the parser
    return None
