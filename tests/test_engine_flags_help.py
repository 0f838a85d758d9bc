"""The engine flags come from one place: every `EngineArgs` field is a flag of both scripts, listed
by --help with the field's default and help text, and the --config files still set them; a script
whose extra is missing says which extra to install."""

import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

from jaxtier.engine import args as engine_args
from jaxtier.engine.args import EngineArgs

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The batch job's --seed is its own flag: it seeds each record's sampling (default: none).
SCRIPTS = {"serve.py": (), "batch_infer.py": ("seed",)}
FLAG_LINE = re.compile(r"^\s+--(?:\[no\])?(\w+):")


def _env() -> dict[str, str]:
  """The environment of a script run: this checkout's jaxtier first on the path."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  return env


def _help_blocks(script: str) -> dict[str, str]:
  """`script --help`, as each flag's block of text, whitespace removed (absl wraps lines)."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--help"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
  assert "Traceback" not in proc.stderr, proc.stderr
  blocks, name = {}, None
  for line in proc.stdout.splitlines():
    match = FLAG_LINE.match(line)
    if match:
      name = match.group(1)
      blocks[name] = ""
    elif not line.startswith(" "):
      name = None  # a module's heading
    if name is not None:
      blocks[name] += "".join(line.split())
  return blocks


def _shown_default(value) -> str | None:
  if value is None:
    return None
  return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_lists_every_engine_argument_with_its_default_and_help(script):
  blocks = _help_blocks(script)
  for field in dataclasses.fields(EngineArgs):
    if field.name in SCRIPTS[script]:
      continue
    assert field.name in blocks, f"{script} --help does not list --{field.name}"
    block = blocks[field.name]
    assert "".join(engine_args.field_help(field.name).split()) in block, (field.name, block)
    default = _shown_default(field.default)
    if default is None:
      assert "(default:" not in block, (field.name, block)
    else:
      assert f"(default:'{default}')" in block, (field.name, block)
    choices = engine_args.field_choices(field.name)
    if choices:
      assert f"<{'|'.join(choices)}>:" in block, (field.name, block)


def test_every_field_is_documented():
  for field in dataclasses.fields(EngineArgs):
    assert engine_args.field_help(field.name).strip(), field.name
    assert f"    {field.name}: " in EngineArgs.__doc__, field.name


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_config_files_give_valid_engine_arguments(config):
  """A config's engine fields, set as the scripts set them, are valid `EngineArgs`."""
  code = (
      "import sys\n"
      "from absl import flags\n"
      "from jaxtier.engine import args as engine_args, flags as engine_flags\n"
      "FLAGS = flags.FLAGS\n"
      "FLAGS(['x', '--config=' + sys.argv[1]])\n"
      "for name, value in FLAGS.config.items():\n"
      "  if name in engine_flags.ENGINE_FLAGS:\n"
      "    FLAGS[name].value = value\n"
      "engine_args.EngineArgs(**engine_flags.llm_kwargs())\n"
      "print('ok')\n")
  proc = subprocess.run([sys.executable, "-c", code, config], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env=_env())
  assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("script, args, module, extra", [
    ("serve.py", [], "fastapi", "server"),
    ("doctor.py", ["--stats=s.json", "--trace=t.jsonl", "--plot=p.png"], "matplotlib", "plot")])
def test_a_missing_extra_is_one_line_naming_it(script, args, module, extra):
  """Without its extra a script ends with one line naming it (the module hidden as if absent)."""
  code = ("import runpy, sys\n"
          f"sys.modules[{module!r}] = None\n"
          f"sys.argv = [{script!r}] + {args!r}\n"
          f"runpy.run_path({os.path.join(ROOT, 'scripts', script)!r}, run_name='__main__')\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        cwd=ROOT, env=_env())
  assert proc.returncode == 1, proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert f'pip install -e ".[{extra}]"' in proc.stderr, proc.stderr
