/* Stand-in for registry.k8s.io/e2e-test-images/nonewprivs: installed setuid root and
 * run as a non-root user, it prints its effective uid. Without no_new_privs the
 * setuid bit makes it 0; with no_new_privs it stays the caller's uid. */
#include <stdio.h>
#include <unistd.h>

int main(void) {
    printf("Effective uid: %d\n", (int)geteuid());
    return 0;
}
