"""Device maps, with torch.distributed.rpc's (TensorPipe's) semantics.

``set_device_map(to, {local: remote})`` says where this worker's CUDA tensors go on worker
``to`` when they are sent in a *request*; the *response* follows the inverse map back. Without
a map, only CPU tensors travel: a CUDA tensor raises at the sender, with torch's message.

Maps are applied by the sender: the descriptor of a CUDA tensor names the device it is to land
on (transport/tensors.py), and the receiver places it there or fails with ``DeviceMapError``
when it has no such device. Every worker publishes its maps, devices and CUDA device count at
rendezvous; ``validate_device_maps`` then checks them all as torch does, so a bad map fails
``init_rpc`` on every worker, with torch's messages, instead of a later call.

Distributed autograd sends gradients back the way their tensors came: the gradients of
tensors received in a request follow the inverse of the requester's map, those of tensors
received in a response follow this worker's own map to the responder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from zmqautograd.transport.errors import DeviceMapError

DeviceMapping = dict[torch.device, torch.device]
Placement = Callable[[torch.device], str]


def to_device(value: Any) -> torch.device:
    """``0`` -> cuda:0, ``"cuda:1"`` / ``torch.device`` as they are (cpu or cuda only)."""
    if isinstance(value, bool):
        raise TypeError(f"not a device: {value!r}")
    device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device maps support cpu and cuda devices, got {device}")
    return device


def to_device_map(device_map: Mapping[Any, Any]) -> DeviceMapping:
    """torch's ``_to_device_map``: normalised, and 1-to-1."""
    full: DeviceMapping = {}
    reverse: DeviceMapping = {}
    for key, value in device_map.items():
        source, target = to_device(key), to_device(value)
        if target in reverse and reverse[target] != source:
            raise ValueError(
                "`set_device_map` only supports 1-to-1 mapping, "
                f"trying to map {reverse[target]} and {source} to {target}"
            )
        full[source] = target
        reverse[target] = source
    return full


def encode_maps(device_maps: Mapping[str, DeviceMapping]) -> dict[str, dict[str, str]]:
    """For the rendezvous record (JSON)."""
    return {peer: {str(k): str(v) for k, v in mapping.items()} for peer, mapping in device_maps.items()}


def decode_maps(encoded: Mapping[str, Mapping[str, str]]) -> dict[str, DeviceMapping]:
    return {peer: {torch.device(k): torch.device(v) for k, v in mapping.items()} for peer, mapping in encoded.items()}


def _valid_indices(devices: Iterable[torch.device], device_count: int) -> bool:
    return all(d.type == "cpu" or (d.index is not None and 0 <= d.index < device_count) for d in devices)


def validate_device_maps(
    all_names: list[str],
    all_device_counts: Mapping[str, int],
    all_device_maps: Mapping[str, Mapping[str, DeviceMapping]],
    all_devices: Mapping[str, list[torch.device]],
) -> None:
    """torch's ``_validate_device_maps`` (static groups), with its messages."""
    for node in all_names:
        devices = all_devices[node]
        if len(set(devices)) != len(devices):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devices}")
        if not _valid_indices(devices, all_device_counts[node]):
            raise ValueError(
                f"Node {node} has devices with invalid indices\n"
                f"devices = {devices}\n"
                f"device count = {all_device_counts[node]}"
            )
    for source_node in all_names:
        if not set(all_device_maps[source_node]).issubset(all_names):
            raise ValueError(
                f"Node {source_node} has invalid target node names in its device maps\n"
                f"device maps = {all_device_maps[source_node].keys()}\n"
                f"node names = {all_names}"
            )
        for target_node, map_ in all_device_maps[source_node].items():
            if len(set(map_.values())) != len(map_):
                raise ValueError(
                    f"Node {source_node} has duplicated target devices in its device map for {target_node}\n"
                    f"device map = {map_}"
                )
            if all_devices[source_node]:
                if not set(map_).issubset(all_devices[source_node]):
                    raise ValueError(
                        f"Node {source_node} has unexpected source devices in its device map for {target_node}\n"
                        f"device map = {map_}\n"
                        f"devices = {all_devices[source_node]}"
                    )
            elif not _valid_indices(map_, all_device_counts[source_node]):
                raise ValueError(
                    f"Node {source_node} has source devices with invalid indices in its device map for "
                    f"{target_node}\ndevice map = {map_}\ndevice count = {all_device_counts[source_node]}"
                )
            if all_devices.get(target_node):
                if not set(map_.values()).issubset(all_devices[target_node]):
                    raise ValueError(
                        f"Node {source_node} has unexpected target devices in its device map for {target_node}\n"
                        f"device map = {map_}\n"
                        f"devices = {all_devices[target_node]}"
                    )
            elif target_node in all_device_counts and not _valid_indices(map_.values(), all_device_counts[target_node]):
                raise ValueError(
                    f"Node {source_node} has target devices with invalid indices in its device map for "
                    f"{target_node}\ndevice map = {map_}\ndevice count = {all_device_counts[target_node]}"
                )


_CPU_ONLY = (
    "zmqautograd RPC only supports CPU tensors by default, please move your tensors to CPU before "
    "sending them over RPC, or call `set_device_map` on `ZmqRpcBackendOptions` to explicitly "
    "configure device mapping. "
)


class DevicePlacement:
    """Where the CUDA tensors of each outgoing message go, for one worker.

    Args:
        me: this worker's name.
        all_device_maps: every worker's maps, ``{worker: {peer: {its device: peer's device}}}``.
    """

    def __init__(self, me: str, all_device_maps: Mapping[str, Mapping[str, DeviceMapping]]):
        self.me = me
        self._request = {peer: dict(mapping) for peer, mapping in all_device_maps.get(me, {}).items()}
        # Responses to a caller follow the inverse of the caller's map to us.
        self._response = {
            caller: {target: source for source, target in maps[me].items()}
            for caller, maps in all_device_maps.items() if me in maps
        }
        # Placements made once per peer and direction: every message asks for one.
        self._placements: dict[tuple[str, str], Placement] = {}

    def sending_devices(self) -> list[torch.device]:
        """This worker's CUDA devices that tensors may leave from: the sources of its maps and
        of the inverses of its callers' maps, in order."""
        devices = [source for mapping in self._request.values() for source in mapping]
        devices += [source for mapping in self._response.values() for source in mapping]
        return sorted({device for device in devices if device.type == "cuda"}, key=lambda device: device.index or 0)

    def request(self, peer: str) -> Placement:
        """For a request to ``peer``: this worker's map to it."""
        return self._cached("Request", peer, self._request)

    def response(self, caller: str) -> Placement:
        """For the response to ``caller``: the inverse of the caller's map to us."""
        return self._cached("Response", caller, self._response)

    def _cached(self, direction: str, peer: str, maps: Mapping[str, DeviceMapping]) -> Placement:
        placement = self._placements.get((direction, peer))
        if placement is None:
            placement = self._placements[(direction, peer)] = self._placement(
                maps.get(peer), f"{direction} device mapping is not available for destination {peer}"
            )
        return placement

    @staticmethod
    def _placement(mapping: DeviceMapping | None, missing: str) -> Placement:
        def place(device: torch.device) -> str:
            target = mapping.get(device) if mapping else None
            if target is None:
                raise DeviceMapError(_CPU_ONLY + missing + f" (a tensor on {device})")
            return str(target)

        return place
