"""`template_root` for the hook: cookiecutter hands hooks a local template's path as typed, relative to a
directory the hook does not run in, so the root is taken from this file, imported before any chdir."""

from pathlib import Path

from jinja2.ext import Extension


class TemplateRoot(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        environment.globals["template_root"] = str(Path(__file__).resolve().parents[2])
