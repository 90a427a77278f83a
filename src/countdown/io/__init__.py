"""Files that no concurrent run, kill, full disk or bad path can lose: one checked path for every write.

Every writer in countdown (artifacts, sweep tables and reports, training checkpoints, saved models, the
model and data caches, benchmark results) goes through this module:

* :func:`atomic_path` / :func:`atomic_write`: the new content goes to a private temporary folder beside
  the target (``<name>.countdown-tmp-<pid>.<random>/``; a library that itself writes through a temporary
  file, as safetensors does, writes it in there too), is fsync'ed, given the mode the target had (or the
  umask's, as ``open()`` would), then renamed over the target (``os.replace`` is atomic on POSIX), and
  the folder is fsync'ed so the rename itself survives a crash. A reader sees the old file or the new one,
  never a mix; a process killed half-way (kill -9, SIGTERM) leaves the old file intact and its temporary
  folder is removed by the next writer of that path. A symbolic link at the target is written through:
  its target file is replaced, the link stays. A target without any write permission (mode 0444) is
  refused, not replaced.
* :func:`atomic_folder` / :func:`files_into`: the same for a folder written whole (a saved model) or for
  files added to an existing folder (``save_pretrained`` into a folder that keeps its other files).
* :func:`writing`: every OS error of a write (disk full, read-only file system, permission, a name too
  long, an I/O error), raised by Python or by safetensors' Rust writer, becomes one
  :class:`WriteError`: one line naming what could not be written, where, why, and the fix, and saying
  that the previous file is unchanged.
* :func:`file_lock`: an advisory ``fcntl`` lock on ``.<name>.lock`` beside the output, held for a whole
  run. A second run on the same output stops at once (or waits, if asked) with a message naming the lock
  file and the process that holds it, so two runs never both print "wrote". The holder removes the lock
  file as it lets go (while still holding it; a new holder checks that the file it locked is still the
  path's), so no lock file stays beside an output.
* :func:`check_writable` / :func:`check_writable_dir`: refuse what is no regular file (a FIFO, a device, a
  socket: :func:`refuse_special`, whatever ``force`` says) or an empty path, then create the target's folder
  and a probe file in it *before* any work starts, so an unwritable ``--out`` fails in a second, not after an hour of
  calibration; :func:`claim_output` checks and locks in one step (what every command does with each
  output before it loads the model).
* :func:`adding_rows` / :func:`read_table`: a CSV table that several runs add rows to (``countdown bench``),
  each row marked with its run, merged under the table's lock: no run replaces another's rows.
* :func:`read_safetensors`: read a safetensors file through one open file, so a writer replacing it at
  the same moment cannot pair one file's header with another's tensors (safetensors' own ``safe_open``
  opens the path a second time for the tensors).
* :func:`describe_os_error`: the one line the command line prints for any OS error.

One module a concern: ``errors.py`` (OS errors as one line), ``files.py`` (atomic files and folders),
``locks.py`` (checks before the work, locks), ``tables.py`` (tables several runs add to), ``safetensors_file.py`` (reading an artifact safely).
"""

from __future__ import annotations

from .errors import (LockedError, NAME_MAX, REPLACED, TMP_MARK, UnwritableError, WriteError, _ALWAYS_WRITE, _RUST_OS_ERROR, _WRITE_ERRNOS, _concerns, _error, _free, _name_max, _related, describe_os_error, explain, os_error_of, write_error, writing)  # noqa: F401
from .files import (_alive, _check_name, _clean_stale, _default_mode, _fit, _fsync_dir, _fsync_file, _fsync_tree, _make_work_dir, _opt, _refuse_read_only, _tmp_prefix, _umask, _write_all, atomic_folder, atomic_path, atomic_write, entry_kind, files_into, fix_modes, glob_escape, lock_file_of, read_only_mount, recover, refuse_special, resolve_link, write_json)  # noqa: F401
from .locks import (_holder, check_writable, check_writable_dir, claim_output, file_lock)  # noqa: F401
from .tables import RUN, adding_rows, read_table, run_id, table_text  # noqa: F401
from .safetensors_file import (_PROC_FD, _parse_safetensors, read_safetensors)  # noqa: F401
