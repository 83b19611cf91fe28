from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PodSandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_READY: _ClassVar[PodSandboxState]
    SANDBOX_NOTREADY: _ClassVar[PodSandboxState]
SANDBOX_READY: PodSandboxState
SANDBOX_NOTREADY: PodSandboxState

class VersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class VersionResponse(_message.Message):
    __slots__ = ("version", "runtime_name", "runtime_version", "runtime_api_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_NAME_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_API_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    runtime_name: str
    runtime_version: str
    runtime_api_version: str
    def __init__(self, version: _Optional[str] = ..., runtime_name: _Optional[str] = ..., runtime_version: _Optional[str] = ..., runtime_api_version: _Optional[str] = ...) -> None: ...

class Int64Value(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class UInt64Value(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class PodSandboxMetadata(_message.Message):
    __slots__ = ("name", "uid", "namespace", "attempt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    uid: str
    namespace: str
    attempt: int
    def __init__(self, name: _Optional[str] = ..., uid: _Optional[str] = ..., namespace: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class PodSandboxConfig(_message.Message):
    __slots__ = ("metadata", "labels", "annotations")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    metadata: PodSandboxMetadata
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    def __init__(self, metadata: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunPodSandboxRequest(_message.Message):
    __slots__ = ("config", "runtime_handler")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    config: PodSandboxConfig
    runtime_handler: str
    def __init__(self, config: _Optional[_Union[PodSandboxConfig, _Mapping]] = ..., runtime_handler: _Optional[str] = ...) -> None: ...

class RunPodSandboxResponse(_message.Message):
    __slots__ = ("pod_sandbox_id",)
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    def __init__(self, pod_sandbox_id: _Optional[str] = ...) -> None: ...

class StopPodSandboxRequest(_message.Message):
    __slots__ = ("pod_sandbox_id",)
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    def __init__(self, pod_sandbox_id: _Optional[str] = ...) -> None: ...

class StopPodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemovePodSandboxRequest(_message.Message):
    __slots__ = ("pod_sandbox_id",)
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    def __init__(self, pod_sandbox_id: _Optional[str] = ...) -> None: ...

class RemovePodSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PodSandboxStatusRequest(_message.Message):
    __slots__ = ("pod_sandbox_id", "verbose")
    POD_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    VERBOSE_FIELD_NUMBER: _ClassVar[int]
    pod_sandbox_id: str
    verbose: bool
    def __init__(self, pod_sandbox_id: _Optional[str] = ..., verbose: _Optional[bool] = ...) -> None: ...

class PodSandboxStatus(_message.Message):
    __slots__ = ("id", "metadata", "state", "created_at", "labels", "annotations", "runtime_handler")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    id: str
    metadata: PodSandboxMetadata
    state: PodSandboxState
    created_at: int
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    runtime_handler: str
    def __init__(self, id: _Optional[str] = ..., metadata: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., state: _Optional[_Union[PodSandboxState, str]] = ..., created_at: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., runtime_handler: _Optional[str] = ...) -> None: ...

class PodSandboxStatusResponse(_message.Message):
    __slots__ = ("status", "info", "timestamp")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    status: PodSandboxStatus
    info: _containers.ScalarMap[str, str]
    timestamp: int
    def __init__(self, status: _Optional[_Union[PodSandboxStatus, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ..., timestamp: _Optional[int] = ...) -> None: ...

class PodSandboxStateValue(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: PodSandboxState
    def __init__(self, state: _Optional[_Union[PodSandboxState, str]] = ...) -> None: ...

class PodSandboxFilter(_message.Message):
    __slots__ = ("id", "state", "label_selector")
    class LabelSelectorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABEL_SELECTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: PodSandboxStateValue
    label_selector: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[PodSandboxStateValue, _Mapping]] = ..., label_selector: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListPodSandboxRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: PodSandboxFilter
    def __init__(self, filter: _Optional[_Union[PodSandboxFilter, _Mapping]] = ...) -> None: ...

class PodSandbox(_message.Message):
    __slots__ = ("id", "metadata", "state", "created_at", "labels", "annotations", "runtime_handler")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    id: str
    metadata: PodSandboxMetadata
    state: PodSandboxState
    created_at: int
    labels: _containers.ScalarMap[str, str]
    annotations: _containers.ScalarMap[str, str]
    runtime_handler: str
    def __init__(self, id: _Optional[str] = ..., metadata: _Optional[_Union[PodSandboxMetadata, _Mapping]] = ..., state: _Optional[_Union[PodSandboxState, str]] = ..., created_at: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., runtime_handler: _Optional[str] = ...) -> None: ...

class ListPodSandboxResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PodSandbox]
    def __init__(self, items: _Optional[_Iterable[_Union[PodSandbox, _Mapping]]] = ...) -> None: ...

class StreamPodSandboxesRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: PodSandboxFilter
    def __init__(self, filter: _Optional[_Union[PodSandboxFilter, _Mapping]] = ...) -> None: ...

class StreamPodSandboxesResponse(_message.Message):
    __slots__ = ("pod_sandboxes",)
    POD_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    pod_sandboxes: _containers.RepeatedCompositeFieldContainer[PodSandbox]
    def __init__(self, pod_sandboxes: _Optional[_Iterable[_Union[PodSandbox, _Mapping]]] = ...) -> None: ...

class ImageSpec(_message.Message):
    __slots__ = ("image", "annotations", "user_specified_image", "runtime_handler", "image_ref")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    USER_SPECIFIED_IMAGE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_HANDLER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_REF_FIELD_NUMBER: _ClassVar[int]
    image: str
    annotations: _containers.ScalarMap[str, str]
    user_specified_image: str
    runtime_handler: str
    image_ref: str
    def __init__(self, image: _Optional[str] = ..., annotations: _Optional[_Mapping[str, str]] = ..., user_specified_image: _Optional[str] = ..., runtime_handler: _Optional[str] = ..., image_ref: _Optional[str] = ...) -> None: ...

class AuthConfig(_message.Message):
    __slots__ = ("username", "password", "auth", "server_address", "identity_token", "registry_token")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    username: str
    password: str
    auth: str
    server_address: str
    identity_token: str
    registry_token: str
    def __init__(self, username: _Optional[str] = ..., password: _Optional[str] = ..., auth: _Optional[str] = ..., server_address: _Optional[str] = ..., identity_token: _Optional[str] = ..., registry_token: _Optional[str] = ...) -> None: ...

class ImageFilter(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ...) -> None: ...

class ListImagesRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: ImageFilter
    def __init__(self, filter: _Optional[_Union[ImageFilter, _Mapping]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("id", "repo_tags", "repo_digests", "size", "uid", "username", "spec", "pinned")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPO_TAGS_FIELD_NUMBER: _ClassVar[int]
    REPO_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    id: str
    repo_tags: _containers.RepeatedScalarFieldContainer[str]
    repo_digests: _containers.RepeatedScalarFieldContainer[str]
    size: int
    uid: Int64Value
    username: str
    spec: ImageSpec
    pinned: bool
    def __init__(self, id: _Optional[str] = ..., repo_tags: _Optional[_Iterable[str]] = ..., repo_digests: _Optional[_Iterable[str]] = ..., size: _Optional[int] = ..., uid: _Optional[_Union[Int64Value, _Mapping]] = ..., username: _Optional[str] = ..., spec: _Optional[_Union[ImageSpec, _Mapping]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ListImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class StreamImagesRequest(_message.Message):
    __slots__ = ("filter",)
    FILTER_FIELD_NUMBER: _ClassVar[int]
    filter: ImageFilter
    def __init__(self, filter: _Optional[_Union[ImageFilter, _Mapping]] = ...) -> None: ...

class StreamImagesResponse(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class ImageStatusRequest(_message.Message):
    __slots__ = ("image", "verbose")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VERBOSE_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    verbose: bool
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ..., verbose: _Optional[bool] = ...) -> None: ...

class ImageStatusResponse(_message.Message):
    __slots__ = ("image", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    image: Image
    info: _containers.ScalarMap[str, str]
    def __init__(self, image: _Optional[_Union[Image, _Mapping]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PullImageRequest(_message.Message):
    __slots__ = ("image", "auth", "sandbox_config")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_CONFIG_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    auth: AuthConfig
    sandbox_config: PodSandboxConfig
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ..., auth: _Optional[_Union[AuthConfig, _Mapping]] = ..., sandbox_config: _Optional[_Union[PodSandboxConfig, _Mapping]] = ...) -> None: ...

class PullImageResponse(_message.Message):
    __slots__ = ("image_ref",)
    IMAGE_REF_FIELD_NUMBER: _ClassVar[int]
    image_ref: str
    def __init__(self, image_ref: _Optional[str] = ...) -> None: ...

class RemoveImageRequest(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: ImageSpec
    def __init__(self, image: _Optional[_Union[ImageSpec, _Mapping]] = ...) -> None: ...

class RemoveImageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImageFsInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FilesystemIdentifier(_message.Message):
    __slots__ = ("mountpoint",)
    MOUNTPOINT_FIELD_NUMBER: _ClassVar[int]
    mountpoint: str
    def __init__(self, mountpoint: _Optional[str] = ...) -> None: ...

class FilesystemUsage(_message.Message):
    __slots__ = ("timestamp", "fs_id", "used_bytes", "inodes_used")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FS_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INODES_USED_FIELD_NUMBER: _ClassVar[int]
    timestamp: int
    fs_id: FilesystemIdentifier
    used_bytes: UInt64Value
    inodes_used: UInt64Value
    def __init__(self, timestamp: _Optional[int] = ..., fs_id: _Optional[_Union[FilesystemIdentifier, _Mapping]] = ..., used_bytes: _Optional[_Union[UInt64Value, _Mapping]] = ..., inodes_used: _Optional[_Union[UInt64Value, _Mapping]] = ...) -> None: ...

class ImageFsInfoResponse(_message.Message):
    __slots__ = ("image_filesystems", "container_filesystems")
    IMAGE_FILESYSTEMS_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FILESYSTEMS_FIELD_NUMBER: _ClassVar[int]
    image_filesystems: _containers.RepeatedCompositeFieldContainer[FilesystemUsage]
    container_filesystems: _containers.RepeatedCompositeFieldContainer[FilesystemUsage]
    def __init__(self, image_filesystems: _Optional[_Iterable[_Union[FilesystemUsage, _Mapping]]] = ..., container_filesystems: _Optional[_Iterable[_Union[FilesystemUsage, _Mapping]]] = ...) -> None: ...

class CreateContainerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartContainerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopContainerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveContainerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListContainersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListContainersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamContainersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamContainersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStatusResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateContainerResourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateContainerResourcesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReopenContainerLogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReopenContainerLogResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecSyncRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecSyncResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PortForwardRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PortForwardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListContainerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListContainerStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamContainerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamContainerStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PodSandboxStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PodSandboxStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPodSandboxStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPodSandboxStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamPodSandboxStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamPodSandboxStatsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateRuntimeConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateRuntimeConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointContainerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointPodRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointPodResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RestorePodRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RestorePodResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerEventResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMetricDescriptorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMetricDescriptorsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPodSandboxMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPodSandboxMetricsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamPodSandboxMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamPodSandboxMetricsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RuntimeConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RuntimeConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdatePodSandboxResourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdatePodSandboxResourcesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
