"""Pipeline schedules as data: which (micro-batch, stage) runs at which clock tick.

A schedule here is a pure function of the number of micro-batches M and stages
K; it can be printed and checked without running a model. The engine executes
the forward actions in tick order and the backward actions in the reverse order.
"""

SCHEDULE_NAMES = ("gpipe",)


def clock_cycles(num_microbatches, num_stages):
    """GPipe's fill-drain forward schedule.

    At tick t (0 <= t < M + K - 1) stage k runs micro-batch t - k, so stage k
    of micro-batch m overlaps stage k + 1 of micro-batch m - 1.

    >>> clock_cycles(3, 2)
    [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]

    Returns:
      A list of M + K - 1 ticks, each a list of (micro_batch, stage) pairs.
    """
    m_count, k_count = int(num_microbatches), int(num_stages)
    if m_count < 1 or k_count < 1:
        raise ValueError(
            f"clock_cycles needs num_microbatches >= 1 and num_stages >= 1, "
            f"got {num_microbatches} and {num_stages}."
        )
    return [
        [(t - k, k) for k in range(k_count) if 0 <= t - k < m_count]
        for t in range(m_count + k_count - 1)
    ]


def bubble_fraction(num_microbatches, num_stages):
    """Idle fraction of the GPipe schedule: (K - 1) / (M + K - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


class GPipe:
    """The GPipe schedule: all forwards (fill), then all backwards (drain).

    >>> GPipe().forward_order(2, 2)
    [(0, 0), (1, 0), (0, 1), (1, 1)]
    """

    name = "gpipe"

    def forward_order(self, num_microbatches, num_stages):
        """Forward (micro_batch, stage) actions in execution order."""
        return [a for tick in clock_cycles(num_microbatches, num_stages) for a in tick]

    def backward_order(self, num_microbatches, num_stages):
        """Backward actions: the forward order reversed (the drain)."""
        return self.forward_order(num_microbatches, num_stages)[::-1]

    def __repr__(self):
        return "GPipe()"


def get(schedule):
    """Resolves a schedule name (or instance) to a schedule instance."""
    if isinstance(schedule, GPipe):
        return schedule
    if isinstance(schedule, str) and schedule.lower() == "gpipe":
        return GPipe()
    raise ValueError(
        f"Unknown schedule {schedule!r}. Use one of {list(SCHEDULE_NAMES)} "
        f"or a tfpipe.schedules.GPipe instance."
    )
