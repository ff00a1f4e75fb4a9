/* A stand-in for the NVIDIA driver's libnvidia-ml.so.1, for tests on hosts without a GPU: two GPUs
 * with fixed figures, through the same C calls pynvml makes, none of which raises an alert of the
 * shipped rules (the session appliance reads it). GPU 1 reports no power reading (the
 * call is unsupported), and neither reports remapped rows or retired pages (the calls are not in
 * this library), so the exporter's handling of both is tested too.
 * Built by tests/support/nvml.py: cc -shared -fPIC -o libnvidia-ml.so.1 fake_nvml.c */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define OK 0
#define INVALID_ARGUMENT 2
#define NOT_SUPPORTED 3
#define GPUS 2u

typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned int gpu, memory; } utilization_t;

static unsigned index_of(void *device) { return (unsigned)((uintptr_t)device - 1); }

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return OK; }
int nvmlInit_v2(void) { return OK; }
int nvmlShutdown(void) { return OK; }
const char *nvmlErrorString(int result) { return result == NOT_SUPPORTED ? "Not Supported" : "Unknown Error"; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = GPUS; return OK; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    if (index >= GPUS) return INVALID_ARGUMENT;
    *device = (void *)(uintptr_t)(index + 1);
    return OK;
}

int nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    (void)device;
    snprintf(name, length, "Fake H200");
    return OK;
}

int nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    snprintf(uuid, length, "GPU-fake-%u", index_of(device));
    return OK;
}

int nvmlDeviceGetMemoryInfo(void *device, memory_t *memory) {
    memory->total = 150000000000ULL;
    memory->used = index_of(device) == 0 ? 144000000000ULL : 30000000000ULL;
    memory->free = memory->total - memory->used;
    return OK;
}

int nvmlDeviceGetUtilizationRates(void *device, utilization_t *rates) {
    rates->gpu = index_of(device) == 0 ? 87 : 3;
    rates->memory = 40;
    return OK;
}

int nvmlDeviceGetTemperature(void *device, int sensor, unsigned int *celsius) {
    (void)sensor;
    *celsius = index_of(device) == 0 ? 71 : 35;
    return OK;
}

int nvmlDeviceGetPowerUsage(void *device, unsigned int *milliwatts) {
    if (index_of(device) == 1) return NOT_SUPPORTED;
    *milliwatts = 412500;
    return OK;
}

/* errorType 0: corrected, 1: uncorrected; counterType 1: aggregate (since the board was made). */
int nvmlDeviceGetTotalEccErrors(void *device, int errorType, int counterType, unsigned long long *count) {
    (void)counterType;
    *count = errorType == 1 ? (index_of(device) == 1 ? 2 : 0) : 17;
    return OK;
}

int nvmlDeviceGetCurrentClocksEventReasons(void *device, unsigned long long *reasons) {
    *reasons = index_of(device) == 0 ? 0x4 | 0x2 : 0x1; /* power cap and application clocks; idle */
    return OK;
}
