/* Test-container entrypoint: prints the GPU-related device nodes the container
 * sees under /dev (and /dev/infiniband) with their major:minor, and its NVIDIA_*,
 * CUDA_* and TESSERA_* env (what `kubectl logs` shows a user), then sleeps
 * until SIGTERM/SIGINT; with the argument "spin", spins on the CPU instead (a
 * stand-in for a process keeping a GPU busy); with "ok", exits 0 at once (an
 * exec probe); with "once", exits after printing (`kubectl exec POD -- /probe once`). */
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

extern char **environ;

static void stop(int sig) { (void)sig; _exit(0); }

static void list(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, strlen(prefix)) != 0) continue;
        char path[512];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &st) == 0 && S_ISCHR(st.st_mode))
            printf(" %s=%u:%u", path, major(st.st_rdev), minor(st.st_rdev));
    }
    closedir(d);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "ok") == 0) return 0;
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    printf("devices:");
    list("/dev", "nvidia");
    list("/dev/infiniband", "");
    printf("\nenv:");
    for (char **e = environ; *e != NULL; e++)
        if (strncmp(*e, "NVIDIA_", 7) == 0 || strncmp(*e, "CUDA_", 5) == 0 ||
            strncmp(*e, "TESSERA_", 8) == 0)
            printf(" %s", *e);
    printf("\n");
    fflush(stdout);
    if (argc > 1 && strcmp(argv[1], "once") == 0) return 0;
    if (argc > 1 && strcmp(argv[1], "spin") == 0) {
        volatile unsigned long spins = 0;
        for (;;) spins++;
    }
    for (;;) pause();
}
