/* The stand-in pause image's entrypoint (registry.k8s.io/pause): sleeps until
 * SIGTERM or SIGINT. The same program as the integration harness's pause; kept
 * here so that critest's images do not follow the harness's layout. */
#include <signal.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

int main(void) {
    signal(SIGTERM, stop);
    signal(SIGINT, stop);
    for (;;) pause();
}
