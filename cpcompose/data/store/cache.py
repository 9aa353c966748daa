"""Where a run keeps its token stores: data.store_dir, else a per-user cache folder.

The one place that resolves it; every reader (the pre-launch check, each rank's loader, the banner, the build
script) asks :func:`store_dir`. The cache follows the XDG base-directory convention, as Hugging Face's hub cache
and pip's do: ``$XDG_CACHE_HOME/cpcompose/token-stores`` when that variable holds an absolute path, else
``~/.cache/cpcompose/token-stores``. A store's folder is named after its source's absolute path and the record
options (:func:`cached_store_folder`), so runs from any working directory share one store per source.
"""

from __future__ import annotations

import os
from pathlib import Path

from cpcompose.config import ConfigError, Data

__all__ = ["CACHE_SUBFOLDER", "cpcompose_cache_folder", "store_dir", "user_cache_folder"]

CACHE_SUBFOLDER = Path("cpcompose") / "token-stores"
"""The stores' folder inside the user's cache folder."""


def cpcompose_cache_folder() -> Path | None:
    """cpcompose's per-user cache: ``$XDG_CACHE_HOME/cpcompose``, else ``~/.cache/cpcompose``; None without a home.

    A relative ``XDG_CACHE_HOME`` is ignored, as the XDG specification says (it would move with the working
    directory). The token stores live in it (:func:`user_cache_folder`), and so does the measured size of a
    rank's process (`cpcompose.training.memory.footprint`).
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / CACHE_SUBFOLDER.parent
    try:
        return Path.home() / ".cache" / CACHE_SUBFOLDER.parent
    except RuntimeError:  # no HOME and no password-database entry (some containers)
        return None


def user_cache_folder() -> Path:
    """The per-user token-store cache: ``$XDG_CACHE_HOME/cpcompose/token-stores``, else under ``~/.cache``.

    Raises:
        ConfigError: no home folder is known (names data.store_dir, the key to set instead).
    """
    root = cpcompose_cache_folder()
    if root is None:
        raise ConfigError("data.store_dir: this process has no home folder for the token-store cache "
                          "(~/.cache/cpcompose/token-stores); set data.store_dir to a writable folder, or "
                          "data.store = false to tokenize in memory")
    return root / CACHE_SUBFOLDER.name


def store_dir(data: Data) -> Path | None:
    """The folder of this run's token stores and sample indexes: data.store_dir when set, else
    :func:`user_cache_folder`; None with data.store = false (the files are tokenized in memory).

    Raises:
        ConfigError: the cache folder cannot be found (see :func:`user_cache_folder`).
    """
    if not data.store:
        return None
    return Path(data.store_dir) if data.store_dir is not None else user_cache_folder()
