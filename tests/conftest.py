import os

import pytest
import torch

import _triton_env


def pytest_configure(config):
    if _triton_env.INTERPRET:
        _triton_env.skip_repeated_lang_patches()
    config.addinivalue_line(
        "markers",
        "interpreter_child(seconds): the test runs a TRITON_INTERPRET=1 child of about that many seconds "
        "(the 2-core CI machine); the session starts these first, the longest first",
    )
    # pytest-xdist's --dist load hands each worker a quarter of its share of the collection at once,
    # in order, so which worker ran which interpreter child (1-4 minutes each, most of the suite's
    # time) fell out of where the files sit in the collection, and the last child could start when
    # the other worker was nearly done. One test at a time, children first (pytest_collection_
    # modifyitems), the workers take the next child as they come free and the short tests fill in
    # the end. Unless the command line asks for another chunk size.
    if getattr(config.option, "dist", "no") == "load" and getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    config.addinivalue_line(
        "markers",
        "long(seconds): the test takes about that many seconds on a cold GPU host (16 cores, -n 8: mostly "
        "kernel compiles and CPU-side torch work); the session starts these first, the longest first",
    )
    # On a GPU host every worker's torch would otherwise take all the cores for its CPU ops: eight
    # workers then ran 16 threads each beside the kernel compiles, and the suite's CPU-side tests took
    # several times their time alone. Each worker gets its share of the cores instead.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and hasattr(config, "workerinput") and torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def _known_seconds(item, gpu_host: bool) -> float:
    """How long the test is known to take where it runs: its ``long`` mark on a GPU host, its
    interpreter child's on a CPU-only machine (the children run only there); 0 when not marked."""
    marker = item.get_closest_marker("long" if gpu_host else "interpreter_child")
    return marker.kwargs.get("seconds", 0) if marker else 0


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)
    # The interpreter children and the long GPU-host tests first, the longest first (pytest_configure
    # says why); the sort is stable, so every other test keeps its place. The same order in every
    # xdist worker.
    items.sort(key=lambda item: -_known_seconds(item, n_gpus > 0))


@pytest.fixture
def quantize_weight_calls(monkeypatch):
    """(shape, transposed) of every Triton ``quantize_weight`` call. Its callers (kernels.operands,
    moemlp._quantized_weights) look it up on the module object at each call, so patching the module
    is seen. Imported here, not at the top: the interpreter child must decorate the kernels under
    TRITON_INTERPRET=1 (tests/_triton_env.py)."""
    from moemlp.kernels.quant import api as kq

    calls = []
    original = kq.quantize_weight

    def counting(w, recipe, transposed=False):
        calls.append((tuple(w.shape), transposed))
        return original(w, recipe, transposed=transposed)

    monkeypatch.setattr(kq, "quantize_weight", counting)
    return calls


@pytest.fixture
def dequantized_weight_calls(monkeypatch):
    """(shape, dim) of every Triton ``dequantized_weight`` call: the weight passes of mxfp8 and nvfp4
    (kernels.operands.Weight, moemlp._quantized_weights), which look it up on the module object at
    each call, as ``quantize_weight_calls`` says."""
    from moemlp.kernels.quant import api as kq

    calls = []
    original = kq.dequantized_weight

    def counting(w, recipe, dim=-1, **kwargs):
        calls.append((tuple(w.shape), dim))
        return original(w, recipe, dim=dim, **kwargs)

    monkeypatch.setattr(kq, "dequantized_weight", counting)
    return calls


def pytest_sessionfinish(session):
    """Under pytest-xdist each worker hands its interpreter children's counts to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["moemlp_child_results"] = list(_triton_env.CHILD_RESULTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: collect a finished worker's interpreter-child counts."""
    results = getattr(node, "workeroutput", {}).get("moemlp_child_results", [])
    _triton_env.CHILD_RESULTS.extend(tuple(r) for r in results)


def pytest_terminal_summary(terminalreporter):
    """Each TRITON_INTERPRET=1 child counts as one test above; say how many cases ran inside."""
    results = _triton_env.CHILD_RESULTS
    if results:
        passed = sum(r[1] for r in results)
        skipped = sum(r[2] for r in results)
        terminalreporter.write_line(
            f"interpreter children: {len(results)} tests above ran {passed} Triton kernel cases under "
            f"TRITON_INTERPRET=1 ({skipped} skipped inside), all passed"
        )
