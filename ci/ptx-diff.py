#!/usr/bin/env python3
"""Which kernels' PTX a change alters, without a GPU: compiles kernels/ at two git revisions with NVRTC (the
PyPI build ci/check-kernels.sh installs into target/nvrtc-venv) for compute_90, and compares each kernel's PTX
with line information, label numbers and shared-variable names normalised. A refactor of the kernels that
prints no changed kernel compiles to the same instructions.

    target/nvrtc-venv/bin/python ci/ptx-diff.py BASE [HEAD]     (HEAD: the working tree when left out)
    target/nvrtc-venv/bin/python ci/ptx-diff.py --regs [NAME..]  registers, stack and spills per kernel of the
                                                                working tree for sm_90 (ptxas -v through NVRTC),
                                                                the kernels whose names contain a NAME
"""
import ctypes
import difflib
import glob
import os
import re
import subprocess
import sys

SOURCES = ["common.cuh", "quant.cuh", "matvec.cu", "elementwise.cu", "attention.cu", "gemm.cu", "sampling.cu",
           "experts.cu"]  # the order of engine/src/backend/cuda/compile.rs KERNEL_SOURCES
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvrtc():
    libs = glob.glob(os.path.join(ROOT, "target/nvrtc-venv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so*"))
    if not libs:
        sys.exit("ptx-diff: no NVRTC in target/nvrtc-venv: run ci/check-kernels.sh first")
    lib_dir = os.path.dirname(libs[0])
    for b in glob.glob(os.path.join(lib_dir, "libnvrtc-builtins.so*")):
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)  # NVRTC opens it by name at compile time
    return ctypes.CDLL(libs[0])


def source(rev):
    text = ""
    for f in SOURCES:
        if rev is None:
            with open(os.path.join(ROOT, "kernels", f)) as fh:
                body = fh.read()
        else:
            body = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:kernels/{f}"], check=True,
                                  capture_output=True, text=True).stdout
        text += f"// ---- kernels/{f}\n{body}\n"
    return text


def compile_program(lib, src, arch):
    """The program compiled for `arch` with the engine's options (and ptxas -v for a real arch): (program, log)."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"strata.cu", 0, None, None) != 0:
        sys.exit("ptx-diff: nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"]
    if arch.startswith("sm_"):
        opts.append(b"--ptxas-options=-v")
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status != 0:
        sys.exit("ptx-diff: the kernels do not compile:\n" + log.value.decode()[-3000:])
    return prog, log.value.decode()


def ptx(lib, src):
    prog, _ = compile_program(lib, src, "compute_90")
    size = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, out)
    return out.value.decode()


def regs(lib, src, names):
    """ptxas -v's lines per kernel for sm_90: registers, stack frame, spills, shared memory."""
    _, log = compile_program(lib, src, "sm_90")
    lines = log.split("\n")
    for i, line in enumerate(lines):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if not m or (names and not any(n in m.group(1) for n in names)):
            continue
        props = "; ".join(re.sub(r"^ptxas\s+(info\s+:|\.)\s*", "", l.strip()) for l in lines[i + 2:i + 4])
        print(f"{m.group(1)}: {props}")


def kernels(text):
    """Each kernel's PTX lines, normalised: no line information or comments, label and local-depot numbers
    dropped, every shared variable called SHARED (its size stays)."""
    out = {}
    for m in re.finditer(r"\.visible \.entry (\w+)\(", text):
        body = text[m.start():text.find("\n}\n", m.start())]
        lines = []
        for line in body.split("\n"):
            s = line.strip()
            if not s or s.startswith((".loc", "//", ".file")):
                continue
            s = re.sub(r"\$L__BB\d+_", "$L__BB_", s)
            s = re.sub(r"__local_depot\d+", "__local_depot", s)
            s = re.sub(r"_ZZ\w+", "SHARED", s)
            lines.append(s)
        out[m.group(1)] = lines
    return out


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--regs":
        regs(nvrtc(), source(None), sys.argv[2:])
        return
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    lib = nvrtc()
    base = kernels(ptx(lib, source(sys.argv[1])))
    head = kernels(ptx(lib, source(sys.argv[2] if len(sys.argv) == 3 else None)))
    changed = 0
    for name in sorted(set(base) | set(head)):
        if name not in head:
            print(f"removed  {name}")
        elif name not in base:
            print(f"added    {name}")
        elif base[name] != head[name]:
            changed += 1
            diff = [d for d in difflib.unified_diff(base[name], head[name], lineterm="", n=0)
                    if d.startswith(("+", "-")) and not d.startswith(("+++", "---"))]
            print(f"changed  {name}: {len(diff)} lines differ, first: {diff[:2]}")
    same = sum(1 for n in base if n in head and base[n] == head[n])
    print(f"ptx-diff: {same} kernels compile to the same PTX, {changed} changed")


main()
