"""A run's images: content-addressed files under ``images/``, written once by ``gndpo init``.

An image's id is the sha256 of its bytes, so the same picture in many prompts (or a rerun of init)
is stored once, and the prompt tables and shards name images by id, never by the user's path: the run
keeps working when the source data set moves. Decoding is not storage's business
(:mod:`gndpo.pipeline.run.images`).
"""

from __future__ import annotations

import hashlib
import os

import fsspec

from gndpo.errors import GndpoError
from gndpo.storage.runfs import RunFS

IMAGES = "images"


def image_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_path(image: str) -> str:
    """The run-relative file of image ``image`` (its id)."""
    return f"{IMAGES}/{image[:2]}/{image}"


def put_image(fs: RunFS, data: bytes) -> str:
    """Store ``data`` once under its id and return the id (an image already stored is left as it is)."""
    image = image_id(data)
    fs.create(image_path(image), data)  # False where it exists: the same bytes by construction
    return image


def read_image(fs: RunFS, image: str) -> bytes:
    return fs.read_bytes(image_path(image))


def read_source_image(ref: str, base: str) -> bytes:
    """The bytes of a user's image ``ref``: a path relative to ``base`` (the prompts file's folder), an
    absolute path, or any fsspec URL. A missing or unreadable file is a one-line GndpoError."""
    url = ref if "://" in ref or os.path.isabs(ref) else f"{base.rstrip('/')}/{ref}"
    try:
        with fsspec.open(url, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise GndpoError(f"image not found: {url}") from None
    except Exception as exc:
        raise GndpoError(f"cannot read image {url}: {' '.join(str(exc).split())[:200]}") from None
