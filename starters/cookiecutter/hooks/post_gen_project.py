"""Fill the new folder with the template's files and run the rename step that copier runs too.

cookiecutter renders one folder of this subdirectory; the template itself is the plain repository two
levels up, so it stays a runnable project and both tools produce the same tree. Jinja here uses square
brackets (cookiecutter.json's _jinja2_env_vars): copier renders curly-brace Jinja in every path it scans.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

# Rendered as JSON into raw strings (spaced from their quotes): any answer, quotes or backslashes, arrives intact.
TEMPLATE = Path(json.loads(r""" [[ template_root | tojson ]] """))
ANSWERS = json.loads(r""" [[ cookiecutter | tojson ]] """)

sys.path.insert(0, str(TEMPLATE / "scripts"))
from rename_project import project_files  # noqa: E402  (the template's own files: git's view or a walk)

Path(".gitkeep").unlink()  # only there because cookiecutter will not create an empty folder
for src in project_files(TEMPLATE):
    dst = src.relative_to(TEMPLATE)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
keys = ("examples", "features", "machinery", "project_name", "description", "author", "license")
options = {key: ANSWERS[key] for key in keys}
args = [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]
subprocess.run([sys.executable, "scripts/rename_project.py", ANSWERS["package_name"], *args], check=True)
