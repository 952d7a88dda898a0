"""The keys and version of the loader state's plain-data form.

Keeping them here (instead of string literals scattered through the code) makes the on-disk
and in-memory formats greppable and keeps readers and writers in step.
"""

from __future__ import annotations

from typing import Final

#: Version of the dict returned by ``DataLoader.state_dict()`` (2: the quarantine is one JSON
#: string, so that ``torch.distributed.checkpoint`` sees a fixed set of keys).
STATE_FORMAT_VERSION: Final = 2
#: Versions that ``load_state_dict`` reads.
STATE_VERSIONS_READ: Final = (1, 2)
#: Value of ``STATE_KIND`` in every state, so a foreign dict is recognised at once.
STATE_KIND_VALUE: Final = "lakeloader.loader_state"

# Keys of the loader state dict.
STATE_KIND: Final = "kind"
STATE_VERSION: Final = "version"
STATE_FINGERPRINT: Final = "fingerprint"
STATE_CONFIG_HASH: Final = "config_hash"
STATE_CONFIG: Final = "config"
STATE_EPOCH: Final = "epoch"
STATE_POSITION: Final = "position"
STATE_DROPPED: Final = "rows_dropped"
STATE_NUM_ROWS: Final = "num_rows"
STATE_TOPOLOGY: Final = "topology"
STATE_QUARANTINE: Final = "quarantine"
