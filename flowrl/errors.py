"""User-facing errors.

Every error a user can cause (a broken recipe, an unknown component, a missing file, a missing
optional dependency) is a :class:`FlowrlError`. The CLI prints it as one short message, with
*where* it happened and *how to fix it*, and exits non-zero without a traceback (``--debug``
shows the traceback). Library code raises these; it never calls ``sys.exit``.
"""

from __future__ import annotations

import difflib
import importlib
import unicodedata
from collections.abc import Iterable
from types import ModuleType


class FlowrlError(Exception):
    """An error caused by user input, reported without a traceback.

    Args:
        message: what is wrong, in one sentence.
        where: where it is, e.g. ``"recipes/x.toml: [chunker].sizes"``.
        hint: how to fix it.
    """

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        super().__init__(self.format())

    def format(self) -> str:
        """``where: message`` and the hint, with every control or bidi character shown escaped
        (a message may quote user input, and the terminal must not interpret it)."""
        message = printable(self.message, keep_newlines=True)
        text = f"{printable(self.where)}: {message}" if self.where else message
        if self.hint:
            text += f"\n  hint: {printable(self.hint, keep_newlines=True)}"
        return text


class RecipeError(FlowrlError):
    """A recipe is malformed: syntax, unknown table or key, wrong type, out-of-range value."""


class PluginError(FlowrlError):
    """A plugin failed to load, or two plugins registered the same component name."""


class MissingDependencyError(FlowrlError):
    """An optional dependency (an extra) is not installed."""


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters (newlines too, unless ``keep_newlines``) and invisible
    formatting characters (bidi overrides, zero-width joiners) replaced by escapes such as
    ``\\x1b`` or ``\\u202e``: safe to print to a terminal, and visibly what was typed."""
    out = []
    for ch in str(text):
        if ch == "\n" and keep_newlines:
            out.append(ch)
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
            out.append(ch.encode("unicode_escape").decode("ascii") if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    return "".join(out)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, in the singular for one: a message's count in words.

    >>> counted(1, "iteration"), counted(2, "iteration"), counted(0, "process", "processes")
    ('1 iteration', '2 iterations', '0 processes')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def suggest(name: str, valid: Iterable[str]) -> str:
    """Return a hint naming the closest valid name and listing all of them."""
    valid = sorted(valid)
    same_but_case = [v for v in valid if v.lower() == str(name).lower()]  # "EPG" for "epg": too short for difflib
    close = same_but_case or difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
    listing = ", ".join(valid) if valid else "(none)"
    if close:
        return f"did you mean '{close[0]}'? valid: {listing}"
    return f"valid: {listing}"


#: flowrl's name on the package index, which install hints name: the import package and the command
#: are ``flowrl``, but the distribution name ``flowrl`` on PyPI belongs to an unrelated JAX library
#:, so installing the name ``flowrl`` from the index would get that library instead.
DISTRIBUTION = "flowrl-diffusion"


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency lazily, or explain which extra to install.

    >>> require("json", extra="dev", purpose="tests").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{purpose} needs the optional package '{module}', which is not installed ({exc})",
            hint=f'pip install "{DISTRIBUTION}[{extra}]"',
        ) from exc


#: errno values that mean "the OS would not let this process write there": a full disk or quota, a
#: file too large, a read-only filesystem, no permission, a failing device.
WRITE_ERRNOS = {"ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EACCES", "EPERM", "EIO"}


def os_write_error(exc: OSError, directory, *, where: str, resume: str) -> FlowrlError | None:
    """The one message for an OS error that stopped writing into ``directory`` (a run's metrics or
    checkpoint mid-run: a full disk, a read-only or unwritable path), naming the path and the
    error; None for any other OSError (a network error, a file read elsewhere), which stays a bug
    report with its traceback. ``resume`` is the command that continues the run once it is fixed."""
    import errno
    from pathlib import Path

    name = errno.errorcode.get(exc.errno or -1, "")
    directory = Path(directory).resolve()
    path = Path(str(exc.filename)).resolve() if exc.filename else None
    if name not in WRITE_ERRNOS or (path is not None and directory not in (path, *path.parents)):
        return None
    reason = exc.strerror or str(exc)
    target = f"{path}" if path is not None else f"into {directory}"
    if name in ("ENOSPC", "EDQUOT", "EFBIG"):
        fix = f"free space (or quota) on the filesystem of {directory}"
    elif name == "EIO":
        fix = f"check the device that holds {directory}"
    else:
        fix = f"make {directory} writable"
    return FlowrlError(f"the run stopped: cannot write {target}: {reason}", where=where,
                       hint=f"{fix}, then continue from its last complete checkpoint: {resume}")
