"""Shared fixtures: the real SmolLM2 checkpoint, local `transformers` as the truth, and local swarms.

Swarm fixtures start real processes (bootstrap and nodes) bound to 127.0.0.1, forked from one fork server
that has done their imports (`fork_server`), and stop them by PID when the test module ends, whether it
passed or failed. `three_node_swarm` is one swarm for the modules that only read
it (generation, the OpenAI-style API, the dashboard): started by the first test that asks for it and stopped
after the last one, passed or failed. `netns_bed` is one bed of network namespaces for every test across hosts
in the run (`swarmnode.testing.netns`), deleted at the end whatever happened.
"""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """One fork server for the run: the local swarms' processes start from it without importing torch,
    transformers and hivemind each time (`swarmnode.testing.forkserver`); started by the first process."""
    from swarmnode.testing import forkserver

    with forkserver.ForkServer() as server:
        forkserver.install(server)
        try:
            yield server
        finally:
            _SHARED.close()  # the shared swarm's processes came from it: stopped while it still answers
            forkserver.install(None)


@pytest.fixture(scope="session")
def model_dir():
    from swarmnode.model_prep import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def smollm2_gguf(model_dir):
    """The GGUF file the suite's checkpoint was made from (SmolLM2-135M-Instruct, Q4_1), kept beside it."""
    from swarmnode.model_prep import default_gguf_path

    path = default_gguf_path(model_dir)
    assert path.is_file(), f"prepare_smollm2 keeps {path}"
    return path


@pytest.fixture(scope="session")
def local_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer):
    from swarmnode.testing.workload import chat_inputs

    return chat_inputs(tokenizer, 3)


@pytest.fixture
def swarm_factory(model_dir, tmp_path_factory):
    """Make LocalSwarms that are all closed when the test ends."""
    from swarmnode.testing.local_swarm import LocalSwarm

    swarms = []

    def make(model=None):
        swarm = LocalSwarm(model or model_dir, log_dir=tmp_path_factory.mktemp("swarm-logs"))
        swarms.append(swarm)
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()


@pytest.fixture(scope="session")
def netns_bed():
    """Network namespaces on one bridge, shared by the run's tests across hosts; each module ends the processes
    it started on it. Without root or `ip netns` this fails with the reason."""
    from swarmnode.testing.netns import NetnsBed

    with NetnsBed() as bed:
        yield bed


@dataclass
class ThreeNodeSwarm:
    """Bootstrap, three float32 nodes serving blocks 0:10, 10:20 and 20:30, each exporting metrics, and
    `swarmnode api` in front of them."""

    swarm: object  # swarmnode.testing.local_swarm.LocalSwarm
    nodes: list
    node_metrics: list[str]
    api: object
    url: str


@dataclass
class _SharedSwarm:
    """The one `three_node_swarm` of a run: made on first use, closed after the last test that uses it."""

    swarm: ThreeNodeSwarm | None = None
    last_user: str | None = None

    def get(self, model_dir, tmp_path_factory) -> ThreeNodeSwarm:
        if self.swarm is not None:
            return self.swarm
        from swarmnode.testing.local_swarm import LocalSwarm, free_port

        swarm = LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("three-node-swarm"))
        try:
            swarm.start_bootstrap()
            ports = [free_port() for _ in range(3)]
            nodes = [swarm.launch_node(a, b, extra=["--metrics-port", str(port)])
                     for (a, b), port in zip(((0, 10), (10, 20), (20, 30)), ports)]
            for node in nodes:
                swarm.wait_serving(node)
            metrics = [f"http://127.0.0.1:{port}/metrics" for port in ports]
            for node, url in zip(nodes, metrics):
                swarm.wait_http(url, 30, node)
            api, url = swarm.start_api()
        except BaseException:
            swarm.close()
            raise
        self.swarm = ThreeNodeSwarm(swarm, nodes, metrics, api, url)
        return self.swarm

    def close(self) -> None:
        if self.swarm is not None:
            self.swarm.swarm.close()
            self.swarm = None


_SHARED = _SharedSwarm()

#: Fixtures that start peer processes: a module whose tests ask for one must mark them `swarm`.
PROCESS_FIXTURES = frozenset({"swarm_factory", "three_node_swarm", "netns_bed"})


@functools.cache
def module_lane(path: Path) -> str:
    """Which of the two lanes of `make test` (`pytest -n 2 --dist loadscope`) runs the test module at `path`:
    "processes" when it marks a test `swarm` (it starts peer processes), else "in-process". The modules that
    start processes run one after another on one worker, since they share the machine's two cores and several
    time what a node does; the tests of plain code (the planner, the simulator, the runtime's pieces) run on
    the other worker beside them. Read from the module's source, since xdist's controller, which schedules,
    collects nothing."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "swarm" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "mark":
            return "processes"
    return "in-process"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadscope`, a scope is a lane (`module_lane`): xdist gives each lane to one worker whole."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_lane(root / nodeid.split("::")[0])

    return LaneScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after -k/-m have deselected: the last test that runs is the one that counts
def pytest_collection_modifyitems(session, config, items):
    """Refuse a test that starts peer processes in a module that does not say so (it would run in the wrong
    lane); run the modules that use `three_node_swarm` one after another, where the first of them stands, so
    the shared swarm lives only while they run; note the last test that uses it."""
    unmarked = [item.nodeid for item in items if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
                and module_lane(item.path) != "processes"]
    if unmarked:
        raise pytest.UsageError(f"these tests start peer processes but their module marks no test `swarm` "
                                f"(`pytestmark = pytest.mark.swarm`): {', '.join(unmarked)}")

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    using = [item for item in items if "three_node_swarm" in getattr(item, "fixturenames", ())]
    users = {module(item) for item in using}
    if users:
        first = next(i for i, item in enumerate(items) if module(item) in users)
        grouped = [item for item in items if module(item) in users]
        rest = [item for item in items[first:] if module(item) not in users]
        items[first:] = grouped + rest
    _SHARED.last_user = using[-1].nodeid if using else None  # module order is kept, so it is still the last


@pytest.hookimpl(trylast=True)  # after the item's fixtures (a module's client of the swarm) are torn down
def pytest_runtest_teardown(item, nextitem):
    if item.nodeid == _SHARED.last_user:
        _SHARED.close()


def pytest_sessionfinish(session, exitstatus):
    _SHARED.close()


@pytest.fixture(scope="module")
def three_node_swarm(model_dir, tmp_path_factory) -> ThreeNodeSwarm:
    """The run's shared 3-node swarm with the API (`ThreeNodeSwarm`), for tests that only read it: they
    generate, list and scrape, and never stop, freeze or add a process."""
    return _SHARED.get(model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def swarm3(three_node_swarm):
    """The run's shared swarm (`three_node_swarm`'s): three nodes serving 0:10, 10:20 and 20:30."""
    return three_node_swarm.swarm


@pytest.fixture(scope="module")
def remote(swarm3, model_dir):
    """A client of the shared swarm, one per module that asks for it (a module may define its own)."""
    from swarmnode.client import DistributedModelForCausalLM

    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm3.initial_peers) as model:
        yield model
