"""The cluster-file writer of a calibration: its measured fields written into a cluster file.

:func:`cluster_yaml` / :func:`write_cluster_yaml` put the cluster of a
:class:`~embedtrain.sharding.calibrate.Calibration` into YAML, under the header saying when and
how each figure was measured (:meth:`~embedtrain.sharding.calibrate.Calibration.header`),
keeping a template file's comments and layout.

Example:
    >>> cal = calibrate(load_cluster("configs/clusters/cpu-1x2.yaml"))
    >>> write_cluster_yaml(cal, "configs/clusters/cpu-1x2.yaml",
    ...                    template="configs/clusters/cpu-1x2.yaml")
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from embedtrain.config_io import to_dict
from embedtrain.sharding.calibrate import HEADER, HEADER_CONT, Calibration


def measured_fields(calibration: Calibration) -> set[str]:
    """The cluster fields ``calibration`` measured (the others are ``base``'s)."""
    fields = {"ddr_bandwidth_gb_per_s"}
    if calibration.comms is not None:
        fields |= {"intra_host_gb_per_s", "reduce_scatter_gb_per_s", "all_gather_gb_per_s"}
    if calibration.groups is not None:
        fields.add("sharding_group_ms")
    return fields


_KEY_LINE = re.compile(r"^(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*?)\s*(?P<comment>#.*)?$")
_COMMENT_COLUMN = 31  # where the cluster files' end-of-line comments start (0-based)


def cluster_yaml(calibration: Calibration, template: Optional[str] = None) -> str:
    """The calibrated cluster as YAML text, its header saying when and how it was measured.

    Args:
        calibration: what :func:`calibrate` returned.
        template: an existing cluster file's text to keep (its comments, key order and any
            keys it leaves out): the calibrated keys' values are replaced in place (those it
            lacks are added at its end), an earlier calibration header is replaced, the new one
            goes after its leading comment lines.
            ``None``: every field of :class:`ClusterConfig`, in order.

    Returns:
        The file's text (loadable by :func:`embedtrain.config.load_cluster`).
    """
    header = calibration.header()
    values = to_dict(calibration.cluster)
    if template is None:
        body = [f"{k}: {_yaml_scalar(v)}" for k, v in values.items()]
        return "\n".join(header + body) + "\n"
    lines = template.splitlines()
    kept: list[str] = []
    skipping = False
    for line in lines:  # drop an earlier calibration header
        if line.startswith(HEADER):
            skipping = True
            continue
        if skipping and line.startswith(HEADER_CONT):
            continue
        skipping = False
        kept.append(line)
    lead = 0
    while lead < len(kept) and kept[lead].startswith("#"):
        lead += 1
    measured = measured_fields(calibration)
    seen = set()
    body = []
    for line in kept[lead:]:
        m = _KEY_LINE.match(line)
        if m and m["key"] in measured:
            seen.add(m["key"])
            comment = m["comment"] or ""
            column = line.index(comment) if comment else _COMMENT_COLUMN
            if "calibrated" not in comment:
                comment = (comment + "; " if comment else "# ") + "calibrated, see the header"
            text = f"{m['key']}: {_yaml_scalar(values[m['key']])}"
            line = f"{text.ljust(column - 1)} {comment}"
        body.append(line)
    for key in [k for k in values if k in measured and k not in seen]:  # in field order
        body.append(f"{f'{key}: {_yaml_scalar(values[key])}'.ljust(_COMMENT_COLUMN - 1)} "
                    "# calibrated, see the header")
    return "\n".join(kept[:lead] + header + body) + "\n"


def _yaml_scalar(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def write_cluster_yaml(calibration: Calibration, path: str | os.PathLike,
                       template: Optional[str | os.PathLike] = None) -> None:
    """Writes :func:`cluster_yaml` to ``path`` (``template``: a cluster file whose comments and
    layout to keep, read before ``path`` is written, so it may be ``path`` itself)."""
    text = Path(template).read_text() if template is not None else None
    Path(path).write_text(cluster_yaml(calibration, text))
