"""`python -m research_lm [group=option ...]`: the Hydra CLI over conf/.

Our own errors print one line on stderr and exit 2; an unknown config choice lists the valid ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class UsageError(ValueError):
    pass


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


def main() -> None:
    try:
        check_choices(sys.argv[1:])
    except UsageError as e:
        _fail(str(e))

    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def app(cfg) -> None:
        from research_lm.experiment import run

        hc = HydraConfig.get()
        group = Path(hc.sweep.dir).name if hc.mode.name == "MULTIRUN" else None
        try:
            run(cfg, Path(hc.runtime.output_dir), sweep_group=group)
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    app()


if __name__ == "__main__":
    main()
