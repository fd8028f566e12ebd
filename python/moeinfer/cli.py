"""The ``moeinfer`` command line from Python: ``serve()`` and ``main()``."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, List, Optional, Sequence, Union

from . import _core


def command_args(command: str, model: Optional[Union[str, "os.PathLike[str]"]] = None,
                 **options: Any) -> List[str]:
    """``moeinfer COMMAND`` arguments from keyword options, as the command line spells them.

    ``max_num_seqs=8`` becomes ``--max-num-seqs 8``; True becomes the bare flag
    (``deterministic=True``: ``--deterministic``) and False or None leaves the option out; a
    list or tuple becomes comma-separated values.
    """
    args = [command]
    if model is not None:
        args.append(os.fspath(model))
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [flag, ",".join(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args


def serve(model: Optional[Union[str, "os.PathLike[str]"]] = None, *,
          args: Sequence[str] = (), **options: Any) -> None:
    """Runs the OpenAI-compatible server of ``moeinfer serve`` in this process, until SIGINT
    (Ctrl-C) or SIGTERM drains it (a second one exits at once, as the command does).

    The options are the command's, in Python spelling (``docs/serving.md``), parsed by the
    command's own option parser: ``serve("models/demo", port=8000, max_num_seqs=8,
    api_key="k")`` runs ``moeinfer serve models/demo --port 8000 --max-num-seqs 8
    --api-key k``; ``args`` are appended as they are. Python's own signal handlers come back
    when it returns.

    Raises:
        UsageError: an option the command does not take, or a refused combination.
        EngineError: the model could not be loaded, the port is taken, ...
    """
    _core.run_command(command_args("serve", model, **options) + list(args))


def run(args: Sequence[str]) -> None:
    """Runs any ``moeinfer`` subcommand (``args`` without the program's name) in this process;
    raises UsageError or EngineError with the command's message instead of exiting."""
    _core.run_command(list(args))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moeinfer ARGS``: the ``moeinfer`` command's main with ARGS; returns (and, as
    a script, exits with) its status. SIGINT and SIGPIPE behave as for the executable."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Python's SIGINT handler would only set a flag that nothing reads while the command runs;
    # the command's own (serve's drain) or the default (end the process) is what its users know.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.stdout.flush()
    return _core.main(["moeinfer"] + argv)
