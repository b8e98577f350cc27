"""ringserve as the one-file executable (``packaging/ringserve.spec``) runs it, or not.

PyInstaller sets ``sys.frozen`` in the executable's Python process, and ``sys.executable`` to the
executable itself, which takes ringserve's own arguments (``ringserve serve``), not Python's
(``-m ringserve``).
"""

from __future__ import annotations

import sys

#: Whether this process is the one-file executable's.
FROZEN = bool(getattr(sys, "frozen", False))

#: The command that runs this ringserve again, to which its arguments are appended: the executable,
#: or this interpreter with ``-m ringserve`` and ``-P`` (Python 3.11: the current folder is not put
#: first on ``sys.path``, so a folder named ``ringserve`` there, such as a checkout's parent's,
#: does not shadow the installed package).
SELF = (sys.executable,) if FROZEN else (sys.executable, "-P", "-m", "ringserve")
