"""Rules over rows and results: ``where``/``derive`` on batches, ``having`` and alerts on windows.

Pure (polars, and sqlglot to find UDF calls in SQL): compiled once from a pipeline spec,
applied vectorised by workers and combiners. Imports ``shoal.schemas`` and ``shoal.errors``;
never ``processors`` or ``runtime``.
"""

from shoal.rules.alerts import AlertBook, AlertSpec, Transition, alert_payload
from shoal.rules.expressions import (
    RESULT_BASE_SCHEMA,
    Having,
    RowRules,
    RowsKept,
    compile_having,
    compile_row_rules,
)

__all__ = [
    "RESULT_BASE_SCHEMA",
    "AlertBook",
    "AlertSpec",
    "Having",
    "RowRules",
    "RowsKept",
    "Transition",
    "alert_payload",
    "compile_having",
    "compile_row_rules",
]
