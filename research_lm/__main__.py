"""`python -m research_lm [group=option ...]`: the Hydra CLI over conf/.

Every bad command line (an unknown option, key or flag, a value of the wrong type or out of range, a path that
cannot be read) and our own errors print one line on stderr and exit 2, before any model is built: an unknown
config choice lists the valid ones; the rest is checked by composing the config first (harness/cli_checks.py).
Under torchrun (`torchrun --nproc-per-node 2 -m research_lm ... eplb.expert_parallel=true`, see
research_lm/engine/distributed.py) every rank runs the same work and rank 0 alone writes the run folder, the
logs and the printed table.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from research_lm.harness.cli_checks import USER_ERRORS, UsageError, check_command_line, check_config, one_line

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def config_choices() -> dict[str, list[str]]:
    """Config group -> its options, read from conf/."""
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(CONF_DIR.iterdir())
        if group.is_dir()
    }


def check_choices(argv: list[str]) -> None:
    """Reject `group=option` overrides naming an option that does not exist, listing the valid ones."""
    choices = config_choices()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if key not in choices or not value:
            continue
        for option in value.split(","):
            if option not in choices[key]:
                raise UsageError(f"unknown {key} {option!r}; choose one of: {', '.join(choices[key])}")


def _fail(message: str) -> None:
    print(f"research_lm: error: {message}", file=sys.stderr)
    sys.exit(2)


def _silence_rank() -> list[str]:
    """Hydra overrides for a torchrun rank other than 0: its run folder goes to a temporary directory (removed
    at exit) and its stdout nowhere; stderr stays, for errors. Its logger is `none` (experiment.run)."""
    scratch = tempfile.mkdtemp(prefix="research_lm_rank_")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    return [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}"]


def main() -> None:
    try:
        check_choices(sys.argv[1:])  # first: it lists the options, and needs no composing
        check_command_line(sys.argv[1:], CONF_DIR)
    except UsageError as e:
        _fail(str(e))

    from research_lm.engine.distributed import is_main_process

    if not is_main_process():
        sys.argv += _silence_rank()  # after the user's overrides: the last value wins

    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def app(cfg) -> None:
        from research_lm.harness.experiment import run

        hc = HydraConfig.get()
        group = Path(hc.sweep.dir).name if hc.mode.name == "MULTIRUN" else None
        try:
            check_config(cfg)  # again per job: a sweep's combinations were not all composed up front
            run(cfg, Path(hc.runtime.output_dir), sweep_group=group, overrides=list(hc.overrides.task))
        except USER_ERRORS as e:
            _fail(one_line(e))

    app()


if __name__ == "__main__":
    main()
