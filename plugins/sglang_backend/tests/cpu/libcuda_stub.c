/* Test-only stub of libcuda.so.1 so that sglang-kernel's CUDA-linked extension
 * loads on a machine with no NVIDIA driver. Every driver call reports
 * CUDA_ERROR_NO_DEVICE (100). Build:
 *   gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 libcuda_stub.c
 * and put its folder first on LD_LIBRARY_PATH. */
#define NODEV 100
int cuInit(unsigned int f) { return NODEV; }
int cuDriverGetVersion(int *v) { if (v) *v = 0; return NODEV; }
int cuDeviceGetCount(int *c) { if (c) *c = 0; return NODEV; }
int cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) { if (p) *p = 0; return NODEV; }
int cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) { if (p) *p = 0; return NODEV; }
int cuStreamCreate(void **s, unsigned int f) { return NODEV; }
int cuPointerGetAttribute(void *d, int a, unsigned long long p) { return NODEV; }
int cuCtxPushCurrent_v2(void *c) { return NODEV; }
int cuCtxPopCurrent_v2(void **c) { return NODEV; }
int cuGreenCtxCreate(void **g, void *d, int dev, unsigned int f) { return NODEV; }
int cuGreenCtxDestroy(void *g) { return NODEV; }
int cuGreenCtxGetDevResource(void *g, void *r, int t) { return NODEV; }
int cuCtxFromGreenCtx(void **c, void *g) { return NODEV; }
int cuDevResourceGenerateDesc(void **d, void *r, unsigned int n) { return NODEV; }
int cuDevSmResourceSplitByCount(void *r, unsigned int *n, const void *in, void *rem, unsigned int f, unsigned int m) { return NODEV; }
int cuDeviceGetDevResource(int dev, void *r, int t) { return NODEV; }
int cuGetErrorString(int e, const char **s) { if (s) *s = "CUDA stub: no device"; return 0; }
int cuGetErrorName(int e, const char **s) { if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
