"""Repository contracts: CI runs exactly the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    pytest_part = test_cmd.split("&&")[-1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert pytest_part in ci
    assert '"$rc" -eq 5' in ci  # "no tests ran" is a failure


def test_readme_main_job_input_exists():
    readme = (ROOT / "README.md").read_text()
    main = re.search(r"python -m mtp_jax.generate --input (\S+)", readme)
    assert main and (ROOT / main.group(1)).exists()
