"""``python without_landlock.py COMMAND...``: run COMMAND as on a kernel without Landlock.

A seccomp filter makes ``landlock_create_ruleset`` fail with ENOSYS for this process and every
descendant (a worker host on Linux < 5.13, or booted with ``lsm=`` without landlock), then the
command is executed in its place.
"""

from __future__ import annotations

import errno
import os
import sys

import pyseccomp as sc

if __name__ == "__main__":
    f = sc.SyscallFilter(sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "landlock_create_ruleset")
    f.load()
    os.execv(sys.argv[1], sys.argv[1:])
