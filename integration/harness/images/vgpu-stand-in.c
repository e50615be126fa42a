/* Stands in for HAMi-core's libvgpu.so in tests (no CUDA here). Two things of
 * HAMi-core's contract, nothing more:
 * - it is a shared library the loader maps through /etc/ld.so.preload;
 * - its dlsym hook initialises it on the first lookup of a `cu*` name, and the
 *   first process to do so writes the shared region (CUDA_DEVICE_MEMORY_SHARED_CACHE,
 *   default /tmp/cudevshr.cache) from its own CUDA_DEVICE_* env; a region already
 *   written is kept. Here the region is text: who wrote it, and that env. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

extern char **environ;
int tessera_vgpu_stand_in = 1;

static void *(*real_dlsym)(void *, const char *);
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void write_region(void) {
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (!path || !*path) path = "/tmp/cudevshr.cache";
    int fd = open(path, O_RDWR | O_CREAT, 0666);
    if (fd < 0) return;
    struct stat st;
    if (lockf(fd, F_LOCK, 0) == 0 && fstat(fd, &st) == 0 && st.st_size == 0) {
        char comm[64] = "?", text[4096];
        FILE *f = fopen("/proc/self/comm", "r");
        if (f) {
            if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = '\0';
            fclose(f);
        }
        int n = snprintf(text, sizeof text, "tessera-vgpu-stand-in region\nwriter=%s\n", comm);
        for (char **e = environ; e && *e && n < (int)sizeof text; e++)
            if (strncmp(*e, "CUDA_DEVICE_", 12) == 0 && strncmp(*e, "CUDA_DEVICE_MEMORY_SHARED_CACHE=", 32) != 0)
                n += snprintf(text + n, sizeof text - n, "%s\n", *e);
        if (n > (int)sizeof text) n = sizeof text;
        if (write(fd, text, n) < 0) { /* the reader sees an empty region */ }
    }
    close(fd);
}

void *dlsym(void *handle, const char *symbol) {
    if (!real_dlsym) real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (symbol && symbol[0] == 'c' && symbol[1] == 'u') pthread_once(&once, write_region);
    return real_dlsym ? real_dlsym(handle, symbol) : NULL;
}
