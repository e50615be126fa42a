/* Test-container entrypoint for enforced shares: a dynamically linked program
 * that reports whether the loader mapped a preloaded HAMi-core library
 * (libvgpu.so) into it, first as started, then again in a child it re-executes
 * with an empty environment (as `env -i` would), then sleeps until SIGTERM. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static void stop(int sig) { (void)sig; _exit(0); }

static void report(const char *tag) {
    int envs = 0;
    for (char **e = environ; e && *e; e++) envs++;
    const char *mapped = "none";
    static char line[1024];
    FILE *maps = fopen("/proc/self/maps", "r");
    while (maps && fgets(line, sizeof line, maps)) {
        char *path = strchr(line, '/');
        if (path && strstr(path, "libvgpu.so")) {
            path[strcspn(path, "\n")] = '\0';
            mapped = path;
            break;
        }
    }
    if (maps) fclose(maps);
    printf("preload %s: env=%d mapped=%s\n", tag, envs, mapped);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "child") == 0) {
        report("env-i");
        return 0;
    }
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    report("main");
    pid_t child = fork();
    if (child == 0) {
        char *args[] = {argv[0], "child", NULL};
        char *empty[] = {NULL};
        execve("/proc/self/exe", args, empty);
        _exit(127);
    }
    if (child > 0) waitpid(child, NULL, 0);
    for (;;) pause();
}
