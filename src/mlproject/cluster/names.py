"""Config values in what a scheduler reads: quoted where its reader has quotes, refused where it has none (a line
break ends an #SBATCH line or a YAML comment whatever the quotes)."""

from __future__ import annotations

import re
import unicodedata

from omegaconf import DictConfig, OmegaConf

from mlproject.core.errors import ConfigError

PLAIN = re.compile(r"[\w@%+=:,./-]+")  # no blank, quote, backslash or '#': an #SBATCH argument as it is


def single_line(key: str, value: object, where: str) -> str:
    """`value` as text that stays on one line of `where`: line breaks (YAML's too) and other control characters
    are refused, naming `key`."""
    text = str(value)
    if any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") for ch in text):
        raise ConfigError(
            f"{key}={text!r} holds a line break or control character, which cannot be written into {where}; remove it"
        )
    return text


def sbatch_word(key: str, value: object) -> str:
    """`value` as one argument of an #SBATCH line. sbatch reads these lines itself (src/sbatch/opt.c,
    _get_argument): blanks split arguments, an unquoted '#' starts a comment, quotes group and a backslash escapes
    (inside quotes too), up to the end of the line."""
    text = single_line(key, value, "an #SBATCH line")
    return text if PLAIN.fullmatch(text) else '"' + re.sub(r'(["\\])', r"\\\1", text) + '"'


def container_arg(arg: str) -> str:
    """`arg` as a container's command argument that reaches the process as written: Kubernetes expands $(VAR) in
    command and args, and reads $$ as a literal $."""
    return arg.replace("$", "$$")


def given_run_id(cfg: DictConfig) -> str | None:
    """The run_id the config or an override sets, which every process of the job composes alike; None where it
    is the `${run_id:}` resolver's, the job's own id (SLURM_JOB_ID, the TrainJob's name)."""
    return None if OmegaConf.is_interpolation(cfg, "run_id") else str(cfg.run_id)
