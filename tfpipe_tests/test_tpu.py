"""Stages on TPU cores, checked without a TPU: the stage-to-core mapping on
real `Topology`/`DeviceAssignment` objects (pure Python), and the errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe

from tfpipe import devices
from tfpipe import tpu


def _topology(mesh, block):
    """A TPU topology of mesh (x, y, z, cores per chip) whose host tasks each
    own a block (bx, by) of chips, their devices in (x, y, z, core) order,
    core fastest (as on a v3-8 host: TPU:0 and TPU:1 are chip (0, 0))."""
    size_x, size_y, size_z, cores = mesh
    bx, by = block
    tasks = []
    for tx in range(size_x // bx):
        for ty in range(size_y // by):
            tasks.append([(tx * bx + x, ty * by + y, z, c) for x in range(bx)
                          for y in range(by) for z in range(size_z) for c in range(cores)])
    return tf.tpu.experimental.Topology(mesh_shape=mesh,
                                        device_coordinates=np.array(tasks, np.int32))


V38 = ([2, 2, 1, 2], (2, 2))   # one host, 4 chips x 2 cores (a v3-8)
POD = ([4, 4, 1, 2], (2, 2))   # 4 hosts of 2x2 chips (a v3-32 slice)

# (topology, computation_shape, replicas) -> per replica, (task, ordinal) of
# stage 0..K-1.
MAPPINGS = [
    # K = 8: the replica's ring over the 4 chips is not ordinal order.
    (V38, [2, 2, 1, 2], 1, [[(0, 0), (0, 1), (0, 4), (0, 5), (0, 6), (0, 7), (0, 2), (0, 3)]]),
    # K = 2: both cores of one chip per replica, 4 replicas.
    (V38, [1, 1, 1, 2], 4, [[(0, 0), (0, 1)], [(0, 4), (0, 5)], [(0, 6), (0, 7)],
                            [(0, 2), (0, 3)]]),
    (V38, [2, 1, 1, 2], 2, [[(0, 0), (0, 1), (0, 4), (0, 5)],
                            [(0, 2), (0, 3), (0, 6), (0, 7)]]),
    (V38, [1, 1, 1, 1], 8, [[(0, 0)], [(0, 1)], [(0, 4)], [(0, 5)], [(0, 2)], [(0, 3)],
                            [(0, 6)], [(0, 7)]]),
    # K = 16 over two hosts each, 2 replicas on a 4x4 mesh.
    (POD, [2, 4, 1, 2], 2, [
        [(0, 0), (0, 1), (0, 4), (0, 5), (0, 6), (0, 7), (1, 4), (1, 5), (1, 6), (1, 7),
         (1, 2), (1, 3), (1, 0), (1, 1), (0, 2), (0, 3)],
        [(2, 0), (2, 1), (2, 4), (2, 5), (2, 6), (2, 7), (3, 4), (3, 5), (3, 6), (3, 7),
         (3, 2), (3, 3), (3, 0), (3, 1), (2, 2), (2, 3)]]),
    # One core per chip: replica r takes core r of each of 16 chips.
    (POD, [4, 4, 1, 1], 2, [
        [(0, 0), (0, 2), (1, 0), (1, 2), (0, 4), (0, 6), (1, 4), (1, 6), (2, 0), (2, 2),
         (3, 0), (3, 2), (2, 4), (2, 6), (3, 4), (3, 6)],
        [(0, 1), (0, 3), (1, 1), (1, 3), (0, 5), (0, 7), (1, 5), (1, 7), (2, 1), (2, 3),
         (3, 1), (3, 3), (2, 5), (2, 7), (3, 5), (3, 7)]]),
]


@pytest.mark.parametrize("mesh,shape,replicas,expected", MAPPINGS)
def test_stage_cores_on_real_device_assignments(mesh, shape, replicas, expected):
    topology = _topology(*mesh)
    assignment = tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=shape, num_replicas=replicas)
    k = int(np.prod(shape))
    cores = tpu.stage_cores(assignment, k)
    assert [[(c.task, c.ordinal) for c in row] for row in cores] == expected
    seen = set()
    for r, row in enumerate(cores):
        for s, core in enumerate(row):
            assert (core.replica, core.stage, core.logical_core) == (r, s, s)
            # The task's TPU device `ordinal` sits at the core's coordinates.
            assert tuple(topology.device_coordinates[core.task, core.ordinal]) == \
                core.coordinates
            seen.add((core.task, core.ordinal))
    assert len(seen) == replicas * k  # no core holds two stages


def test_one_chip_holds_at_most_its_cores():
    # computation_shape [1, 1, 1, K] fits K only up to the cores of one chip.
    with pytest.raises(ValueError, match="does not fit"):
        tf.tpu.experimental.DeviceAssignment.build(_topology(*V38),
                                                   computation_shape=[1, 1, 1, 8])


def _v38_assignment(k):
    shape = {2: [1, 1, 1, 2], 8: [2, 2, 1, 2]}[k]
    return tf.tpu.experimental.DeviceAssignment.build(_topology(*V38), computation_shape=shape)


# (device assignment, num_stages) -> error text
ERRORS = [
    (lambda: _v38_assignment(8), 4, r"num_stages=4 but the device assignment has 8 cores "
                                    r"per replica.*computation_shape of 4 cores"),
    (lambda: _v38_assignment(2), 8, r"num_stages=8 but the device assignment has 2 cores"),
    (lambda: _v38_assignment(2), 0, r"num_stages must be a positive int, got 0"),
    (lambda: _v38_assignment(2), 2.0, r"num_stages must be a positive int, got 2.0"),
    (lambda: _v38_assignment(2), True, r"num_stages must be a positive int, got True"),
    (lambda: "v3-8", 2, r"device_assignment must be a tf.tpu.experimental.DeviceAssignment, "
                        r"got str.*DeviceAssignment.build"),
    (lambda: _topology(*V38), 2, r"got Topology"),
]


@pytest.mark.parametrize("make_assignment,num_stages,message", ERRORS)
def test_stage_cores_errors(make_assignment, num_stages, message):
    with pytest.raises(ValueError, match=message):
        tpu.stage_cores(make_assignment(), num_stages)


def test_no_strategy_here_is_a_tpu_strategy():
    assert not tpu.is_tpu_strategy(tf.distribute.get_strategy())
    assert not tpu.is_tpu_strategy(tf.distribute.OneDeviceStrategy("/CPU:0"))


# -- the stage-device abstraction, on logical CPUs ---------------------------

# device -> where a variable and an op made in its scope land
SCOPES = [
    ("/device:CPU:1", "CPU:1"),
    (devices.StageDevice("/device:CPU:2"), "CPU:2"),
    ("/job:localhost/replica:0/task:0/device:CPU:3", "CPU:3"),
]


@pytest.mark.parametrize("device,expected", SCOPES)
def test_stage_device_scope_places_variables_and_ops(device, expected):
    with devices.scope(device):
        v = tf.Variable(1.0)
        t = v * 2.0
    assert v.device.endswith(expected) and t.device.endswith(expected)
    assert devices.as_stage_device(device).name.endswith(expected)


@pytest.mark.parametrize("name, kind, pool", [
    ("/device:CPU:1", devices.LocalCPU, "host memory"),
    ("/job:localhost/replica:0/task:0/device:CPU:3", devices.LocalCPU, "host memory"),
    ("/device:GPU:0", devices.LocalGPU, None),  # no GPU here: TF reports no memory
    ("/job:worker/replica:0/task:1/device:CPU:0", devices.StageDevice, None),  # another task's
])
def test_a_device_name_becomes_its_kind_which_reports_its_memory(name, kind, pool):
    """What a recompute mode nobody gave is chosen from (`tfpipe.recompute_choice`)."""
    device = devices.as_stage_device(name)
    assert type(device) is kind  # pylint: disable=unidiomatic-typecheck
    memory = device.memory()
    assert memory is None if pool is None else (memory[0] == pool and memory[1] > 2**30)


# bad input -> error text
DEVICE_ERRORS = [
    (lambda: devices.scope(3), r"device name \(str\) or a tfpipe.devices.StageDevice, got int"),
    (lambda: devices.StageDevice(""), r"non-empty device name, got ''"),
    (lambda: devices.LogicalCore(None, -1), r"int >= 0, got -1"),
    (lambda: devices.LogicalCore(None, True), r"int >= 0, got True"),
]


@pytest.mark.parametrize("make,message", DEVICE_ERRORS)
def test_stage_device_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_logical_core_is_named_by_its_index_not_a_tpu_device_string():
    strategy = tf.distribute.get_strategy()
    core = devices.LogicalCore(strategy, 3)
    assert core.name == "TPU logical core 3" and "/device:TPU" not in core.name
    assert core == devices.LogicalCore(strategy, 3) != devices.LogicalCore(strategy, 2)


# -- a TPUStrategy on CPU: traces TPU programs, cannot run them --------------------------


def _traced_replicate(strategy, cores):
    """The ops of a traced step that doubles its input once under each logical core."""
    def step(x):
        def replica(x):
            for core in range(cores):
                with devices.scope(devices.LogicalCore(strategy, core)):
                    x = x * 2.0
            return x
        return strategy.run(replica, args=(x,))
    return tf.function(step).get_concrete_function(tf.TensorSpec((4, 2))).graph.get_operations()


# (topology, K cores per replica, R replicas): one host of each kind, K and R pairwise.
TRACING_STRATEGIES = [("v3-8", 2, 1), ("v3-8", 4, 2), ("v3-8", 2, 4), ("v5e-8", 8, 1)]


@pytest.mark.parametrize("topology, cores, replicas", TRACING_STRATEGIES)
def test_tpu_strategy_on_cpu_traces_a_replicated_program_on_k_cores(topology, cores, replicas):
    strategy = tfpipe.testing.tpu_strategy(topology, cores, replicas)
    assert tpu.is_tpu_strategy(strategy) and strategy.num_replicas_in_sync == replicas
    ops = _traced_replicate(strategy, cores)
    meta, = [op for op in ops if op.type == "TPUReplicateMetadata"]
    assert (meta.get_attr("num_replicas"), meta.get_attr("num_cores_per_replica")) == \
        (replicas, cores)
    multiplies = [op.device for op in ops if op.type == "Mul"]
    assert multiplies == [f"/device:TPU_REPLICATED_CORE:{k}" for k in range(cores)]


@pytest.mark.parametrize("args, message", [
    (("v2-8", 2, 1), r"topology='v2-8' is not one of \['v3-8', 'v5e-8'\]"),
    (("v3-8", 3, 1), r"cores_per_replica=3 x num_replicas=1 does not fit a 2x2x1x2 TPU "
                     r"topology's 8 cores; cores_per_replica takes \[1, 2, 4, 8\]"),
    (("v3-8", 4, 4), r"cores_per_replica=4 x num_replicas=4 does not fit"),
])
def test_tpu_strategy_refuses_what_the_host_cannot_hold(args, message):
    with pytest.raises(ValueError, match=message):
        tfpipe.testing.tpu_strategy(*args)


V5E8 = ([2, 4, 1, 1], (2, 4))  # one host, 8 chips x 1 core (a v5e-8)


@pytest.mark.parametrize("mesh, k, r", [(V38, 1, 8), (V38, 2, 4), (V38, 4, 2), (V38, 8, 1),
                                        (V5E8, 2, 4), (V5E8, 8, 1), (POD, 16, 2)])
def test_device_assignment_puts_each_stage_beside_the_one_before(mesh, k, r):
    cores = tpu.stage_cores(tpu.device_assignment(_topology(*mesh), k, r), k)
    assert [len(row) for row in cores] == [k] * r
    assert len({(c.task, c.ordinal) for row in cores for c in row}) == k * r
    for row in cores:  # on the same chip (0) or on a neighbouring one (1)
        assert {sum(abs(a - b) for a, b in zip(c.coordinates[:3], d.coordinates[:3]))
                for c, d in zip(row, row[1:])} <= {0, 1}


@pytest.mark.parametrize("k, r", [(3, 1), (4, 4), (2, 0)])
def test_device_assignment_refuses_what_the_topology_cannot_hold(k, r):
    with pytest.raises(ValueError, match=rf"cores_per_replica={k} x num_replicas={r} does not "
                                         rf"fit a 2x2x1x2 TPU topology's 8 cores; "
                                         rf"cores_per_replica takes \[1, 2, 4, 8\]"):
        tpu.device_assignment(_topology(*V38), k, r)
