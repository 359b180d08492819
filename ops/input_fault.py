"""An op's bad input met in a kernel: recorded in its ``ops.flag_buffer`` words by
``record_fault``, worded for the host's error by a ``fault_message``.

The ops that check their inputs in a kernel (an index out of range, an embedding id) keep
the first fault's ``[1, value, where, limit]`` and word it the same way:
``template.format(value, where, limit)`` and, where the error comes after the call that met
the input (CUDA's ``deferred`` words), which calls those were, in parentheses after it."""
from ops.twin import twin


def _record_fault(bad, value, where, limit):
    """Keep ``[1, value, where, limit]`` in ``bad`` unless a fault is already there (on CUDA
    the first of racing threads' or one of them)."""
    if bad[0] == 0:
        bad[1] = value
        bad[2] = where
        bad[3] = limit
        bad[0] = 1


record_fault_cpu, record_fault_cuda = twin(_record_fault)


def fault_message(template, recent):
    """``message(values, deferred)``: ``template`` filled with the flagged value, where and
    limit (``{0}``, ``{1}``, ``{2}``), then `` (recent)`` when deferred."""
    def message(values, deferred):
        return template.format(*values[1:]) + (f" ({recent})" if deferred else "")
    return message
