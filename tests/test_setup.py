"""scripts/setup.sh installs with uv from the sources pip is configured with (scripts/uv_sources.py):
the reference is pip itself (its `config list` of a configuration written here) and uv finding a
package that only pip's configured wheel folder holds."""

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import uv_sources  # noqa: E402  (a script of the set-up, not a package)

UV = Path(sys.executable).with_name("uv")


def pip_config_list(config: Path, **env: str) -> str:
    """pip's own listing of a configuration file, with none of this machine's PIP_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean |= {"PIP_CONFIG_FILE": str(config), **env}
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=clean, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_install_sections_and_pips_variables_decide_as_they_do_for_pip(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nindex-url = https://mirror.example/simple\n"
        "extra-index-url = file:///one/simple file:///two/simple\nfind-links = /global/wheels\n"
        "cert = /etc/company-ca.pem\n"
        "[install]\nfind-links = /install/wheels\n"
        "[download]\nconstraint = /not/an/install.txt\n"
    )
    listing = pip_config_list(config, PIP_TRUSTED_HOST="mirror.example", PIP_DEFAULT_TIMEOUT="99")
    args = uv_sources.uv_args(listing)
    assert flag_values(args, "--index-url") == ["https://mirror.example/simple"]
    assert flag_values(args, "--extra-index-url") == ["file:///one/simple", "file:///two/simple"]
    assert flag_values(args, "--find-links") == ["/install/wheels"]  # [install] over [global]
    assert flag_values(args, "--allow-insecure-host") == ["mirror.example"]  # PIP_TRUSTED_HOST
    assert "/not/an/install.txt" not in args  # another command's section
    assert flag_values(args, "--index-strategy") == ["unsafe-best-match"]  # pip's: best over every index
    env = uv_sources.uv_env(listing)
    assert env["SSL_CERT_FILE"] == "/etc/company-ca.pem" and env["UV_HTTP_TIMEOUT"] == "99"
    # a variable beats the file, as for pip
    args = uv_sources.uv_args(pip_config_list(config, PIP_FIND_LINKS="/env/wheels"))
    assert flag_values(args, "--find-links") == ["/env/wheels"]


def probe_wheel(folder: Path) -> Path:
    """A minimal, valid wheel that exists nowhere but in `folder`."""
    name, version = "sglmem_setup_probe", "1.0"
    files = {
        f"{name}/__init__.py": b"",
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
            for path, data in files.items()
        )
        + f"{name}-{version}.dist-info/RECORD,,\n"
    )
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
        zf.writestr(f"{name}-{version}.dist-info/RECORD", record)
    return wheel


def test_uv_installs_from_the_wheel_folder_pip_is_pointed_at(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    probe_wheel(wheels)
    (tmp_path / "index").mkdir()  # an index with nothing in it: the probe is only in the folder
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nindex-url = file://{tmp_path / 'index'}\nfind-links = {wheels}\n")
    args = uv_sources.uv_args(pip_config_list(config))
    venv = tmp_path / "venv"
    subprocess.run([str(UV), "venv", "-q", str(venv)], check=True)

    def install(*flags: str, cache: str) -> subprocess.CompletedProcess:
        cmd = [str(UV), "pip", "install", "--python", str(venv / "bin" / "python"), "--offline", *flags]
        env = os.environ | {"UV_CACHE_DIR": str(tmp_path / cache)}
        return subprocess.run([*cmd, "sglmem-setup-probe"], env=env, capture_output=True, text=True)

    done = install(*args, cache="cache")
    assert done.returncode == 0, done.stderr
    assert "sglmem-setup-probe==1.0" in done.stderr
    # without pip's sources uv does not find it: the flags are what made the difference
    missed = install("--reinstall", "--index-url", f"file://{tmp_path / 'index'}", cache="cache2")
    assert missed.returncode != 0 and "not found" in missed.stderr, missed.stderr
