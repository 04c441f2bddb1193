"""Models named by a Hugging Face Hub id: `org/name` or `org/name@revision` (a branch, tag
or commit hash) becomes the folder of its snapshot in the hub cache.

Only the files the engine reads are fetched (`ALLOW_PATTERNS`), through `huggingface_hub`,
which keeps them in its cache (`HF_HUB_CACHE`, default `$HF_HOME/hub`, itself default
`~/.cache/huggingface`) and, under `HF_HUB_OFFLINE=1`, reads that cache alone. A string
naming an existing folder is always a path, so local folders load as before; `org/name`
that is not a folder is a hub id. `huggingface_hub` is imported only for a hub id.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from .safetensors_io import CheckpointError

# What `checkpoint.load` and the tokenizer read beside the weights; nothing else is fetched
# (a published repo also holds PyTorch weights, modelling code, images).
ALLOW_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "*.safetensors", "model.safetensors.index.json", "kv_scales.json")

# org/name as the hub spells repo ids (letters, digits, - _ .), then an optional @revision
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?")


class HubError(CheckpointError):
    """A hub id whose files cannot be had: not in the cache while offline, unreachable,
    unknown, gated."""


def parse_hub_id(spec: str) -> Optional[tuple[str, Optional[str]]]:
    """(repo id, revision or None) when `spec` names a hub model, None when it is a path."""
    if os.path.isdir(spec) or ".." in spec:
        return None
    m = _HUB_ID.fullmatch(spec)
    return (m["repo"], m["rev"]) if m else None


def local_path(spec: str) -> str:
    """The local folder of `spec`: itself when it is a path, else its hub snapshot,
    downloaded (only `ALLOW_PATTERNS`) when not yet cached. HubError says why not."""
    parsed = parse_hub_id(spec)
    if parsed is None:
        return spec
    repo, rev = parsed
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache = constants.HF_HUB_CACHE
    try:
        # offline, the cache alone (snapshot_download would still ask the Hub for the file
        # list of a revision given as a commit hash)
        return snapshot_download(repo, revision=rev, allow_patterns=list(ALLOW_PATTERNS),
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise HubError(
                f"{spec} is not in the hub cache {cache} and HF_HUB_OFFLINE=1 forbids "
                "downloading it: fetch it once with network access (same HF_HOME / "
                "HF_HUB_CACHE), or pass a local folder") from None
        raise HubError(f"{spec} could not be downloaded and is not in the hub cache {cache}: "
                       f"{str(e).splitlines()[0]}") from None
    except GatedRepoError:
        raise HubError(f"{spec} is gated on the Hub: accept its terms on the model page and "
                       "log in (HF_TOKEN or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{spec}: no such model on the Hub (or it is private: log in with "
                       "HF_TOKEN); a local folder of that name does not exist either") from None
    except RevisionNotFoundError:
        raise HubError(f"{spec}: the Hub has no revision {rev!r} of {repo}") from None
    except (HfHubHTTPError, OSError) as e:  # HTTP errors, a full disk, an unwritable cache
        raise HubError(f"{spec}: downloading into {cache} failed: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                       ) from None
