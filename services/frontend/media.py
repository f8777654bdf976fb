"""Fetching and decoding images (and video clips, ``video.py``) for the frontend: bounded, off the event
loop, and hard to abuse. Videos follow the same URL, SSRF and byte rules with caps of their own.

- ``data:`` URLs always; ``https:`` and ``http:`` (hosts may be restricted with ``--allowed-media-domains``);
  ``file:`` only inside a configured directory (``--local-media-dir``).
- A fetched host is resolved once, every address checked (private, loopback, link-local, metadata and
  other non-global addresses are refused unless allowed), and the checked address is the one dialled,
  so DNS cannot be rebound between check and use. Redirects are followed by hand and re-checked.
- Byte caps apply while streaming; pixel caps apply to the header, before any pixel is decoded
  (decompression bombs); animated images are refused.
- Each image gets a content hash over its decoded pixels, size and mode.
- An image whose bytes were decoded here before is recognised by a hash of those bytes as received (a
  data URL's base64 text, a fetch's body): its content hash and size come from memory (``SeenImages``)
  and it is decoded only if it must be sent (``RecognisedImage``; ``decode``). Chat clients send every
  image again each turn; one a worker holds in its prefix cache then costs no decode at all.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx
import numpy as np
from PIL import Image, UnidentifiedImageError

from services.frontend.errors import ApiError
from services.frontend.seen_images import RecognisedImage, SeenImages
from services.frontend.video import DecodedVideo, VideoLimits, decode_video
from shared.embedding_index import content_digest
from shared.model.video import VideoGeometry

FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # uint8 [height, width, 3]
    content_hash: str

    @property
    def height(self) -> int:
        return self.pixels.shape[0]

    @property
    def width(self) -> int:
        return self.pixels.shape[1]


def content_hash(pixels: np.ndarray, mode: str = "RGB") -> str:
    return content_digest(f"{mode}:{pixels.shape[1]}x{pixels.shape[0]}:", np.ascontiguousarray(pixels).data)


def decode_image(data: bytes, max_pixels: int) -> DecodedImage:
    """Bytes → RGB pixels, refusing what is not a plain still image within the pixel cap."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in FORMATS:
                raise ApiError(400, f"unsupported image format {img.format or 'unknown'}; "
                                    f"use one of {', '.join(sorted(FORMATS))}")
            width, height = img.size
            if width < 1 or height < 1:
                raise ApiError(400, "image has no pixels")
            if width * height > max_pixels:
                raise ApiError(400, f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")
            if getattr(img, "n_frames", 1) > 1:
                raise ApiError(400, "animated or multi-frame images are not supported")
            # writable: tensors view it; an RGB image as it is (``convert`` would copy its 6 MB first)
            pixels = np.array(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
    except ApiError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise ApiError(400, "image data could not be decoded") from None
    return DecodedImage(pixels, content_hash(pixels))


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].lower()


def _address_allowed(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class MediaLoader:
    def __init__(self, settings, executor: Executor, video_geometry: VideoGeometry | None = None,
                 seen: SeenImages | None = None):
        self.settings = settings
        self.executor = executor
        self.video_geometry = video_geometry  # None: this model takes no video
        self.seen = seen  # None: every image is decoded (nothing would skip it)
        self.client = httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                        timeout=httpx.Timeout(settings.fetch_timeout))
        self.decoded = 0  # images decoded, and of the images loaded, those recognised by their bytes instead
        self.recognised = 0

    async def close(self) -> None:
        await self.client.aclose()

    async def load(self, url: str) -> DecodedImage | RecognisedImage:
        """The image, decoded; or recognised by its bytes, not decoded (``decode`` it if it must be sent)."""
        loop = asyncio.get_running_loop()
        if _scheme(url) == "data":  # hashed and decoded (base64 too) off the event loop, in parallel there
            tag, data = b"data:", self._payload(url)
        else:
            tag, data = b"body:", await self._read(url)
        image = await loop.run_in_executor(self.executor, self._load_bytes, tag, data)
        if isinstance(image, RecognisedImage):
            self.recognised += 1
        else:
            self.decoded += 1
        return image

    async def decode(self, image: DecodedImage | RecognisedImage) -> DecodedImage:
        if isinstance(image, DecodedImage):
            return image
        decoded = await asyncio.get_running_loop().run_in_executor(self.executor, self._decode, image.data)
        self.decoded += 1
        return decoded

    def _load_bytes(self, tag: bytes, data: bytes | str) -> DecodedImage | RecognisedImage:
        if self.seen is None:
            return self._decode(data)
        key = self.seen.key(tag, data)
        if (known := self.seen.recall(key, data)) is not None:
            return known
        image = self._decode(data)
        self.seen.remember(key, image)
        return image

    def _decode(self, data: bytes | str) -> DecodedImage:
        """Bytes, or a data URL's base64 payload, → the image."""
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, "image data URL is not valid base64") from None
        return decode_image(data, self.settings.max_image_pixels)

    # -- video ------------------------------------------------------------------------------------
    async def load_media(self, parts: list[tuple[str, object]], embeds=None) -> list:
        """``(kind, url)`` pairs, ``kind`` "image" or "video", decoded in parallel, in their order; parts of
        precomputed embeddings (``("image_embeds", part)``) read by ``embeds`` (an ``EmbedsReader``) there too."""
        loop = asyncio.get_running_loop()

        def load(kind: str, value):
            if kind == "image_embeds":
                return loop.run_in_executor(self.executor, embeds.read, value)
            return self.load_video(value) if kind == "video" else self.load(value)

        return list(await asyncio.gather(*(load(k, v) for k, v in parts)))

    async def load_video(self, url: str) -> DecodedVideo:
        if self.video_geometry is None:
            raise ApiError(400, "this model does not take video input")
        data = await self._read(url, "video")
        limits = VideoLimits(max_frames=self.settings.max_video_frames)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, decode_video, data, self.video_geometry, limits)

    # -- bytes of either kind ---------------------------------------------------------------------
    async def _read(self, url: str, kind: str = "image") -> bytes:
        scheme = _scheme(url)
        if scheme == "data":
            return self._data_url(url, kind)  # a clip's: its decode dwarfs the base64
        if scheme in ("https", "http"):
            try:
                return await asyncio.wait_for(self._fetch(url, kind), self.settings.fetch_timeout)
            except asyncio.TimeoutError:
                raise ApiError(400, f"fetching the {kind} URL timed out") from None
        if scheme == "file" and self.settings.local_media_dir:
            return await asyncio.to_thread(self._local_file, url, kind)
        allowed = "data:, https:, http:" + (", file:" if self.settings.local_media_dir else "")
        raise ApiError(400, f"unsupported {kind} URL scheme; allowed: {allowed}")

    def _data_url(self, url: str, kind: str = "image") -> bytes:
        try:
            return base64.b64decode(self._payload(url, kind), validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{kind} data URL is not valid base64") from None

    def _payload(self, url: str, kind: str = "image") -> str:
        """A data URL's base64 text, its form and size checked."""
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().startswith(f"data:{kind}/") or not header.lower().endswith(";base64"):
            raise ApiError(400, f"{kind} data URLs must look like data:{kind}/<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.settings.max_media_bytes:
            raise ApiError(400, f"{kind} exceeds {self.settings.max_media_bytes} bytes")
        return payload

    def _local_file(self, url: str, kind: str = "image") -> bytes:
        root = Path(self.settings.local_media_dir).resolve()
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ApiError(400, "file URLs must name a local path")
        path = (root / unquote(parts.path).lstrip("/")).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise ApiError(400, "file URL is outside the local media directory or does not exist")
        if path.stat().st_size > self.settings.max_media_bytes:
            raise ApiError(400, f"{kind} exceeds {self.settings.max_media_bytes} bytes")
        return path.read_bytes()

    async def _fetch(self, url: str, kind: str = "image") -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            target, host_header, host = await self._checked_target(url)
            request = self.client.build_request("GET", target, headers={"Host": host_header, "Accept": f"{kind}/*"},
                                                extensions={"sni_hostname": host})
            try:
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError:
                raise ApiError(400, f"the {kind} URL could not be fetched") from None
            try:
                if response.is_redirect:
                    location = response.headers.get("location", "")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise ApiError(400, f"fetching the {kind} URL returned HTTP {response.status_code}")
                return await self._capped_body(response, kind)
            finally:
                await response.aclose()
        raise ApiError(400, f"the {kind} URL redirects too often")

    async def _capped_body(self, response: httpx.Response, kind: str = "image") -> bytes:
        cap = self.settings.max_media_bytes
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise ApiError(400, f"{kind} exceeds {cap} bytes")
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > cap:
                raise ApiError(400, f"{kind} exceeds {cap} bytes")
        return bytes(body)

    async def _checked_target(self, url: str) -> tuple[str, str, str]:
        """The URL rewritten to a checked IP address, the Host header, and the host name for TLS."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ApiError(400, "image URL redirects to a scheme that is not allowed")
        host = (parts.hostname or "").lower()
        if not host or "@" in parts.netloc or "\\" in url:
            raise ApiError(400, "image URL has no host or carries credentials")
        domains = self.settings.allowed_media_domains
        if domains and not any(host == d or host.endswith("." + d) for d in domains):
            raise ApiError(400, "image URL host is not in the allowed media domains")
        port = parts.port or (443 if scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            raise ApiError(400, "image URL host could not be resolved") from None
        addresses = [info[4][0] for info in infos]
        if not self.settings.allow_private_media and not all(_address_allowed(a) for a in addresses):
            raise ApiError(400, "image URL resolves to a private or reserved address")
        address = addresses[0]
        literal = f"[{address}]" if ":" in address else address
        path = parts.path or "/"
        query = f"?{parts.query}" if parts.query else ""
        default_port = parts.port is None or parts.port == (443 if scheme == "https" else 80)
        host_header = host if default_port else f"{host}:{port}"
        return f"{scheme}://{literal}:{port}{path}{query}", host_header, host
