"""Build the token stores and sample indexes a run's config names, ahead of time.

The trainer builds them on first use too (in the launching process, before any rank starts, into data.store_dir
or the per-user cache ~/.cache/cpcompose/token-stores); this command is for a cluster: build once on one machine,
copy the printed store folders, and on the cluster point data.path (or each [[data.sources]] path) at the copied
folders, with the same tokenizer and data.format. A copied store is read as it is: its sources need not be there.

    python -m cpcompose.data.build_token_store --config my_run.toml [--section.key=value ...] [--histogram lengths.png]

Installed as the `cpcompose-build-token-store` command too. Exit status 2 with a one-line message for a bad file,
record or option (as the trainer's pre-launch check).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from cpcompose.config import ConfigError, load_config
from cpcompose.data.loader import build_token_stores
from cpcompose.data.store import store_mixture, uses_store
from cpcompose.data.tokenizer import config_tokenizer

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The `cpcompose-build-token-store` command and `python -m cpcompose.data.build_token_store`.

    Args:
        argv: the trainer's options, and `--histogram PNG` for a plot of the document lengths (default: this
            process's arguments).

    Returns:
        The exit code: 0 built (or found up to date), 2 a bad file, record or option (its line on stderr).
    """
    argv = sys.argv[1:] if argv is None else argv
    png = None
    if "--histogram" in argv:
        at = argv.index("--histogram")
        png, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2 :]
    try:
        config = load_config(argv)
        if config.data.source != "text":
            raise ConfigError("data.source: token stores hold files' text: set data.source = 'text' and data.path")
        if not uses_store(config):
            raise ConfigError("data.store: false tokenizes in memory, and there is nothing to build; remove it")
        start = time.perf_counter()
        notes = build_token_stores(config)  # the vocabulary, then every store and sample index, built where missing or stale
        mixture = store_mixture(config, config_tokenizer(config))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    samples = config.training.steps * config.training.batch_size
    for line in mixture.report(samples, png):
        print(line)
    for store, note in zip(mixture.stores, notes):
        print(f"store {store.folder}: {store.num_tokens:,} tokens ({store.manifest['dtype']}); {note}")
    print(f"ready in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
