/* Stand-in for registry.k8s.io/e2e-test-images/nginx, as critest looks at it: a
 * process named "nginx" whose command line reads "nginx: master process ...", that
 * writes its pid to /var/run/nginx.pid and serves HTTP 200 on a port (80 unless
 * NGINX_PORT says otherwise) through a busybox httpd worker; SIGTERM, SIGINT or
 * SIGQUIT stops both at once. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MASTER "nginx: master process nginx -g daemon off;"

static pid_t worker;

static void stop(int sig) {
    (void)sig;
    if (worker > 0) kill(worker, SIGTERM);
    _exit(0);
}

int main(int argc, char **argv) {
    (void)argc;
    /* Like nginx, show "master process" as the whole first word of the command line:
     * exec this same file (so the process name stays "nginx") under that argv[0]. */
    if (strcmp(argv[0], MASTER) != 0) {
        char *args[] = {MASTER, NULL};
        execv("/usr/sbin/nginx", args);
        perror("exec /usr/sbin/nginx");
        return 1;
    }
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    signal(SIGQUIT, stop);
    FILE *pidfile = fopen("/var/run/nginx.pid", "w");
    if (pidfile) {
        fprintf(pidfile, "%d\n", (int)getpid());
        fclose(pidfile);
    }
    const char *port = getenv("NGINX_PORT");
    if (!port || !*port) port = "80";
    worker = fork();
    if (worker == 0) {
        execl("/bin/busybox", "httpd", "-f", "-p", port, "-h", "/usr/share/nginx/html", (char *)NULL);
        perror("exec busybox httpd");
        _exit(1);
    }
    printf("nginx stand-in: pid %d, busybox httpd worker %d on port %s\n", (int)getpid(), (int)worker, port);
    fflush(stdout);
    int status;
    while (waitpid(worker, &status, 0) < 0) {
        if (errno != EINTR) return 1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
