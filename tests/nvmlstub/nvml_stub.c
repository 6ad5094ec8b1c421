/* A stand-in libnvidia-ml.so.1 for tests: NVML's C API (types and calls as nvml.h declares them), answering
 * from a fixture host's data (stub_data.h, written by tests/nvmlstub/__init__.py). Every other function NVML
 * exports is generated beside this file and answers NVML_ERROR_NOT_SUPPORTED; which symbols the library
 * exports is set by the linker's version script, so a test can build one with fewer. STUB_HANG names a
 * function that never returns (a GPU that fell off the bus). */

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96

typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;

/* nvmlGpuInstanceProfileInfo_t's fields, which _v2 has after its version (with a name after them) */
#define GPU_INSTANCE_PROFILE_FIELDS \
    unsigned int id;                \
    unsigned int isP2pSupported;    \
    unsigned int sliceCount;        \
    unsigned int instanceCount;     \
    unsigned int multiprocessorCount; \
    unsigned int copyEngineCount;   \
    unsigned int decoderCount;      \
    unsigned int encoderCount;      \
    unsigned int jpegCount;         \
    unsigned int ofaCount;          \
    unsigned long long memorySizeMB;

typedef struct {
    GPU_INSTANCE_PROFILE_FIELDS
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    GPU_INSTANCE_PROFILE_FIELDS
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} nvmlGpuInstanceProfileInfo_v2_t;

/* the engines a compute instance (or a MIG device) has: nvmlComputeInstanceProfileInfo_t, nvmlDeviceAttributes_t */
#define SHARED_ENGINE_FIELDS              \
    unsigned int multiprocessorCount;     \
    unsigned int sharedCopyEngineCount;   \
    unsigned int sharedDecoderCount;      \
    unsigned int sharedEncoderCount;      \
    unsigned int sharedJpegCount;         \
    unsigned int sharedOfaCount;

typedef struct {
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    SHARED_ENGINE_FIELDS
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    SHARED_ENGINE_FIELDS
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

/* The fixture's data: struct stub_profile, stub_mig, stub_gpu and their tables */
struct stub_profile {
    unsigned int index;
    const char *name;
    unsigned int slices;
    unsigned long long memory_mib;
};

struct stub_mig {
    unsigned int gpu_instance;
    unsigned int compute_instance;
    unsigned int profile;
    const char *uuid;
};

struct stub_gpu {
    const char *bus_id;
    unsigned int pci_device_id;
    const char *uuid;
    const char *name;
    const char *serial;
    const char *part_number;
    unsigned int minor;
    int brand;
    int architecture;
    int cc_major, cc_minor;
    unsigned long long memory_mib;
    int mig_mode;
    unsigned int mig_count;
    struct stub_mig migs[8];
    unsigned int profile_count;
    struct stub_profile profiles[16];
};

#include "stub_data.h"

#ifndef STUB_HANG
#define STUB_HANG ""
#endif

#define MAX_GPUS 16
#define MAX_MIGS 8
#define MIB (1024ULL * 1024ULL)

struct stub_handle {
    int gpu;
    int mig; /* -1: the whole GPU */
};

typedef struct stub_handle *nvmlDevice_t;
struct stub_instance {
    int gpu;
    int mig;
};
typedef struct stub_instance *nvmlGpuInstance_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

/* A MIG device's compute instance: the stub models one per GPU instance, spanning it */
typedef struct stub_instance *nvmlComputeInstance_t;

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

static struct stub_handle gpu_handles[MAX_GPUS];
static struct stub_handle mig_handles[MAX_GPUS][MAX_MIGS];
static struct stub_instance instances[MAX_GPUS][MAX_MIGS];
static int initialized;

static void hang_point(const char *function) {
    if (strcmp(STUB_HANG, function) == 0)
        for (;;)
            pause();
}

#define ENTER()                                   \
    hang_point(__func__);                         \
    if (!initialized)                             \
        return NVML_ERROR_UNINITIALIZED;

static unsigned int gpu_count(void) { return sizeof(stub_gpus) / sizeof(stub_gpus[0]); }

static const struct stub_gpu *gpu_of(nvmlDevice_t device) {
    if (device == NULL || device->gpu < 0 || (unsigned int)device->gpu >= gpu_count())
        return NULL;
    return &stub_gpus[device->gpu];
}

static const struct stub_mig *mig_of(nvmlDevice_t device) {
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL || device->mig < 0 || (unsigned int)device->mig >= gpu->mig_count)
        return NULL;
    return &gpu->migs[device->mig];
}

/* The whole GPU `device` is, NULL for a MIG device, a bad handle or no `out` to answer in */
static const struct stub_gpu *parent_of(nvmlDevice_t device, const void *out) {
    return out == NULL || device == NULL || device->mig >= 0 ? NULL : gpu_of(device);
}

/* The whole GPU `device` is, when it is in MIG mode */
static nvmlReturn_t mig_parent(nvmlDevice_t device, const void *out, const struct stub_gpu **gpu) {
    *gpu = parent_of(device, out);
    if (*gpu == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    return (*gpu)->mig_mode == 1 ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

static const struct stub_profile *profile_of(const struct stub_gpu *gpu, unsigned int index) {
    for (unsigned int i = 0; i < gpu->profile_count; i++)
        if (gpu->profiles[i].index == index)
            return &gpu->profiles[i];
    return NULL;
}

static nvmlReturn_t copy_text(const char *value, char *out, unsigned int length) {
    if (value == NULL)
        return NVML_ERROR_NOT_SUPPORTED;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, value);
    return NVML_SUCCESS;
}

/* A GPU's value or text (`gpu`, `device` in scope), and a MIG device's (`mig`) */
#define GPU_GETTER(function, type, value)                           \
    nvmlReturn_t function(nvmlDevice_t device, type *out) {         \
        ENTER();                                                    \
        const struct stub_gpu *gpu = gpu_of(device);                \
        if (gpu == NULL || out == NULL)                             \
            return NVML_ERROR_INVALID_ARGUMENT;                     \
        *out = (type)(value);                                       \
        return NVML_SUCCESS;                                        \
    }

#define GPU_TEXT(function, value)                                                  \
    nvmlReturn_t function(nvmlDevice_t device, char *out, unsigned int length) {   \
        ENTER();                                                                   \
        const struct stub_gpu *gpu = gpu_of(device);                               \
        return gpu == NULL ? NVML_ERROR_INVALID_ARGUMENT : copy_text(value, out, length); \
    }

#define MIG_GETTER(function, field)                                 \
    nvmlReturn_t function(nvmlDevice_t device, unsigned int *out) { \
        ENTER();                                                    \
        const struct stub_mig *mig = mig_of(device);                \
        if (out == NULL || gpu_of(device) == NULL)                  \
            return NVML_ERROR_INVALID_ARGUMENT;                     \
        if (mig == NULL)                                            \
            return NVML_ERROR_NOT_SUPPORTED;                        \
        *out = mig->field;                                          \
        return NVML_SUCCESS;                                        \
    }

/* NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE for a compute instance that spans a GPU instance of `slices` */
static unsigned int compute_profile(unsigned int slices) {
    switch (slices) {
    case 1: return 0;
    case 2: return 1;
    case 3: return 2;
    case 4: return 3;
    case 7: return 4;
    default: return 5;
    }
}

/* Start and stop */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    hang_point(__func__);
    for (unsigned int i = 0; i < gpu_count() && i < MAX_GPUS; i++) {
        gpu_handles[i] = (struct stub_handle){(int)i, -1};
        for (int j = 0; j < MAX_MIGS; j++) {
            mig_handles[i][j] = (struct stub_handle){(int)i, j};
            instances[i][j] = (struct stub_instance){(int)i, j};
        }
    }
    initialized++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    ENTER();
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

/* The system */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER();
    return copy_text(STUB_DRIVER_VERSION, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER();
    return copy_text(STUB_NVML_VERSION, version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    ENTER();
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = STUB_CUDA_VERSION;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

/* Devices */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER();
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER();
    if (device == NULL || index >= gpu_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpu_handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    ENTER();
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < gpu_count(); i++) {
        if (strcmp(stub_gpus[i].uuid, uuid) == 0) {
            *device = &gpu_handles[i];
            return NVML_SUCCESS;
        }
        for (unsigned int j = 0; j < stub_gpus[i].mig_count; j++)
            if (strcmp(stub_gpus[i].migs[j].uuid, uuid) == 0) {
                *device = &mig_handles[i][j];
                return NVML_SUCCESS;
            }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *device) {
    ENTER();
    if (bus_id == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    size_t given = strlen(bus_id);
    for (unsigned int i = 0; i < gpu_count(); i++) {
        size_t own = strlen(stub_gpus[i].bus_id); /* NVML pads the domain to 8 digits: compare the tails */
        if (given >= 12 && strcasecmp(bus_id + given - 12, stub_gpus[i].bus_id + own - 12) == 0) {
            *device = &gpu_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus_id, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByPciBusId_v2(bus_id, device);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER();
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL || pci == NULL || device->mig >= 0)
        return gpu == NULL || pci == NULL ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_NOT_SUPPORTED;
    unsigned int domain = 0, bus = 0, dev = 0, function = 0;
    sscanf(gpu->bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &function);
    memset(pci, 0, sizeof(*pci));
    snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.%X", domain, bus, dev, function);
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.%X", domain, bus, dev, function);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = gpu->pci_device_id;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

GPU_GETTER(nvmlDeviceGetIndex, unsigned int, device->gpu)
GPU_GETTER(nvmlDeviceGetMinorNumber, unsigned int, gpu->minor)
GPU_GETTER(nvmlDeviceGetBrand, int, gpu->brand)
GPU_GETTER(nvmlDeviceGetArchitecture, unsigned int, gpu->architecture)
GPU_TEXT(nvmlDeviceGetSerial, gpu->serial)
GPU_TEXT(nvmlDeviceGetBoardPartNumber, gpu->part_number)
MIG_GETTER(nvmlDeviceGetGpuInstanceId, gpu_instance)
MIG_GETTER(nvmlDeviceGetComputeInstanceId, compute_instance)

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER();
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct stub_mig *mig = mig_of(device);
    return copy_text(mig != NULL ? mig->uuid : gpu->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER();
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct stub_mig *mig = mig_of(device);
    if (mig == NULL)
        return copy_text(gpu->name, name, length);
    const struct stub_profile *profile = profile_of(gpu, mig->profile);
    char text[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    snprintf(text, sizeof(text), "%s MIG %s", gpu->name, profile ? profile->name : "");
    return copy_text(text, name, length);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    ENTER();
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL || major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = gpu->cc_major;
    *minor = gpu->cc_minor;
    return NVML_SUCCESS;
}

static unsigned long long memory_mib(nvmlDevice_t device) {
    const struct stub_gpu *gpu = gpu_of(device);
    const struct stub_mig *mig = mig_of(device);
    if (mig != NULL) {
        const struct stub_profile *profile = profile_of(gpu, mig->profile);
        return profile ? profile->memory_mib : 0;
    }
    return gpu->memory_mib;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER();
    if (gpu_of(device) == NULL || memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = memory_mib(device) * MIB;
    memory->used = 0;
    memory->free = memory->total;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER();
    if (gpu_of(device) == NULL || memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = memory_mib(device) * MIB;
    memory->reserved = 0;
    memory->used = 0;
    memory->free = memory->total;
    return NVML_SUCCESS;
}

/* MIG */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    ENTER();
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL || current == NULL || pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (gpu->mig_mode < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = (unsigned int)gpu->mig_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig) {
    ENTER();
    if (gpu_of(device) == NULL || is_mig == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = device->mig >= 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    ENTER();
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL || count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (gpu->mig_mode < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *count = 7;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *mig) {
    ENTER();
    const struct stub_gpu *gpu;
    nvmlReturn_t status = mig_parent(device, mig, &gpu);
    if (status == NVML_ERROR_INVALID_ARGUMENT)
        return status;
    if (status != NVML_SUCCESS || index >= gpu->mig_count)
        return NVML_ERROR_NOT_FOUND; /* no MIG device at this index (MIG off: none at any) */
    *mig = &mig_handles[device->gpu][index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *device) {
    ENTER();
    if (mig_of(mig) == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpu_handles[mig->gpu];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *instance) {
    ENTER();
    const struct stub_gpu *gpu;
    nvmlReturn_t status = mig_parent(device, instance, &gpu);
    if (status != NVML_SUCCESS)
        return status;
    for (unsigned int j = 0; j < gpu->mig_count; j++)
        if (gpu->migs[j].gpu_instance == id) {
            *instance = &instances[device->gpu][j];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t instance, nvmlGpuInstanceInfo_t *info) {
    ENTER();
    if (instance == NULL || info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct stub_gpu *gpu = &stub_gpus[instance->gpu];
    const struct stub_mig *mig = &gpu->migs[instance->mig];
    const struct stub_profile *profile = profile_of(gpu, mig->profile);
    memset(info, 0, sizeof(*info));
    info->device = &gpu_handles[instance->gpu];
    info->id = mig->gpu_instance;
    info->profileId = mig->profile;
    info->placement.size = profile ? profile->slices : 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t profile_info(nvmlDevice_t device, unsigned int index, const struct stub_profile **found) {
    const struct stub_gpu *gpu = gpu_of(device);
    if (gpu == NULL || device->mig >= 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (gpu->mig_mode < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *found = profile_of(gpu, index);
    return *found ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int index,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info) {
    ENTER();
    const struct stub_profile *profile = NULL;
    nvmlReturn_t status = info == NULL ? NVML_ERROR_INVALID_ARGUMENT : profile_info(device, index, &profile);
    if (status != NVML_SUCCESS)
        return status;
    unsigned int version = info->version;
    memset(info, 0, sizeof(*info));
    info->version = version;
    info->id = profile->index;
    info->sliceCount = profile->slices;
    info->instanceCount = 7 / profile->slices;
    info->memorySizeMB = profile->memory_mib;
    snprintf(info->name, sizeof(info->name), "MIG %s", profile->name);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int index,
                                                 nvmlGpuInstanceProfileInfo_t *info) {
    nvmlGpuInstanceProfileInfo_v2_t full;
    nvmlReturn_t status = info == NULL ? NVML_ERROR_INVALID_ARGUMENT
                                       : nvmlDeviceGetGpuInstanceProfileInfoV(device, index, &full);
    if (status != NVML_SUCCESS)
        return status;
    memset(info, 0, sizeof(*info));
    info->id = full.id;
    info->sliceCount = full.sliceCount;
    info->instanceCount = full.instanceCount;
    info->memorySizeMB = full.memorySizeMB;
    return NVML_SUCCESS;
}

static const struct stub_profile *instance_profile(nvmlGpuInstance_t instance) {
    const struct stub_gpu *gpu = &stub_gpus[instance->gpu];
    return profile_of(gpu, gpu->migs[instance->mig].profile);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t instance, unsigned int id,
                                                   nvmlComputeInstance_t *compute) {
    ENTER();
    if (instance == NULL || compute == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (stub_gpus[instance->gpu].migs[instance->mig].compute_instance != id)
        return NVML_ERROR_NOT_FOUND;
    *compute = instance;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t compute, nvmlComputeInstanceInfo_t *info) {
    nvmlGpuInstanceInfo_t instance; /* the compute instance spans its GPU instance */
    nvmlReturn_t status = info == NULL ? NVML_ERROR_INVALID_ARGUMENT : nvmlGpuInstanceGetInfo(compute, &instance);
    if (status != NVML_SUCCESS)
        return status;
    memset(info, 0, sizeof(*info));
    info->device = instance.device;
    info->gpuInstance = compute;
    info->id = stub_gpus[compute->gpu].migs[compute->mig].compute_instance;
    info->profileId = compute_profile(instance.placement.size);
    info->placement = instance.placement;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t compute, nvmlComputeInstanceInfo_t *info) {
    return nvmlComputeInstanceGetInfo_v2(compute, info);
}

nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t instance, unsigned int index,
                                                          unsigned int engine, nvmlComputeInstanceProfileInfo_t *info) {
    ENTER();
    if (instance == NULL || info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct stub_profile *profile = instance_profile(instance);
    if (profile == NULL || engine != 0 || index != compute_profile(profile->slices))
        return NVML_ERROR_NOT_SUPPORTED; /* only the compute instance that spans the GPU instance */
    memset(info, 0, sizeof(*info));
    info->id = index;
    info->sliceCount = profile->slices;
    info->instanceCount = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    ENTER();
    const struct stub_mig *mig = mig_of(device);
    if (attributes == NULL || gpu_of(device) == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct stub_profile *profile = mig ? profile_of(gpu_of(device), mig->profile) : NULL;
    if (profile == NULL)
        return NVML_ERROR_NOT_SUPPORTED; /* the stub models a MIG device's */
    memset(attributes, 0, sizeof(*attributes));
    attributes->gpuInstanceSliceCount = profile->slices;
    attributes->computeInstanceSliceCount = profile->slices;
    attributes->memorySizeMB = profile->memory_mib;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

#include "stub_unmodelled.h"
